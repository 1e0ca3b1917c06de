"""A detached job between two attempts, on each node: how the attempt ended here, recorded and told
to the supervisor; the next attempt decided after its delay (the master node, restart_here) or
awaited (every other node, await_restart); then begun with the first attempt's launch line, a
fresh master port and, in an elastic job, the shape of the nodes it runs on (begin).
"""

import os
import time

from ..attempt.checks import PortHold
from ..local.state import per_attempt, write_record
from ..protocol import events, policy, wire
from ..watch.relay import masked
from . import decide
from .members import place

PORT = ("--master-port=", "--main_process_port=")  # torchrun's and ddp-up's own; accelerate's
# The launchers' options that give the job's shape, all before the master port (plan/launch.py's
# launcher_argv): the node count, this node's rank among them, its first global rank, the world size
SHAPE = {"--nnodes=": 3, "--num_machines=": 3, "--node-rank=": 0, "--machine_rank=": 0, "--first-rank=": 1,
         "--world-size=": 2, "--num_processes=": 2}


def port_at(argv):
    return next(i for i, a in enumerate(argv) if a.startswith(PORT))


def with_port(argv, port):
    """The launch line with another master port: the launcher's own option, which comes before
    the script; the script's own arguments are left as they are."""
    at = port_at(argv)
    return argv[:at] + ["%s=%d" % (argv[at].partition("=")[0], port)] + argv[at + 1:]


def relaid(argv, shape):
    """The launch line for another shape of the job, ``shape``: (node rank, first global rank,
    world size, node count), members.place's. Only the launcher's options change."""
    at = port_at(argv)
    head = [name + str(shape[SHAPE[name]]) if name in SHAPE else arg
            for arg, name in ((arg, arg.partition("=")[0] + "=") for arg in argv[:at])]
    return head + argv[at:]


def master_of(argv):
    """The launch line's master, ``addr:port`` (its ``--master-addr=``/``--master-port=``, which
    come before the script), for the record; None if it has none."""
    found = {}
    for arg in argv:
        for name in ("--master-addr=", "--master-port="):
            if arg.startswith(name) and name not in found:
                found[name] = arg[len(name):]
    return "%s:%s" % (found["--master-addr="], found["--master-port="]) if len(found) == 2 else None


def own_failure(failures, ends, first_rank):
    """A failed node's earliest failure, for the supervisor: the first rank that raised (by
    policy.earliest's rule), else the first rank that ended (its global rank), with its own
    time; None if neither is known."""
    if failures:
        first = policy.earliest(failures, lambda f: f["at"], exception=lambda f: f.get("exception"))
        return dict(first, rank=first_rank + first["rank"], error_file=None)
    if ends:
        local, at = min(ends.items(), key=lambda item: item[1])
        return {"rank": first_rank + int(local), "at": at, "exception": None}
    return None


class Restarts:
    """The restarts of ``run`` (a DetachedRun: its spec, record, supervisor or link, launch)."""

    def __init__(self, run):
        self.run = run

    def after_exit(self, code, stopped, reason, failures, ends):
        """Record how the attempt ended here and tell the supervisor (a node whose ranks failed by
        themselves failed, stopped or not, with its earliest failure's own time and exception). The master node's agent
        then waits for every node's end (or loss) and decides: the next attempt (restarts left,
        every node still heard, no one stopped it for good) after its delay, or the job's end,
        recorded. Every other node waits for that word while restarts are left."""
        run = self.run
        state = policy.node_end(bool(failures), stopped, code)
        rank_code = run.launch.report.rank_code() if state == "failed" else None  # the rank's own, as ddp-up reads it
        code = code if rank_code is None else rank_code  # torchrun's is 1 for any rank; no_restart_on_exit reads the rank's
        failure = own_failure(failures, ends, run.ranks[0]) if state == "failed" else None
        if state == "failed" and failure is None and run.launch.report.parser.exception:  # the launcher's own
            failure = {"rank": None, "at": time.time(), "exception": run.launch.report.parser.exception}
        failure = masked(failure, run.out.secrets)  # for the supervisor's outcome, which ddp-ls shows
        more = run.attempt < run.spec.restarts + run.spec.recoveries and not run.for_good  # may restart
        run.record.update(ended=time.time(), state="restarting" if more else state, code=code, reason=reason)
        write_record(run.dir, run.record)
        go, stopped_waiting = None, None
        if run.supervisor is not None:
            run.supervisor.report(run.spec.node, state, code, reason, run.attempt, run.for_good, failure)
            run.supervisor.finished.wait()
            if not run.supervisor.over_event.is_set():
                go, why = self.restart_here()
                if go is None:
                    run.supervisor.over(why)
                    stopped_waiting = why if why == decide.STOPPED_WAITING else None
        elif run.link is not None:
            run.link.report(state, code, reason, run.attempt, run.for_good, failure, keep=more)
            go, stopped_waiting = self.await_restart() if more else (None, None)
        if go is None and more:  # a stop while it waited to restart ends the job stopped, not failed
            run.record.update(state="stopped" if stopped_waiting else state, reason=stopped_waiting or reason)
            write_record(run.dir, run.record)
        return go

    def restart_here(self):
        """The master node, between two attempts: wait the delay (a signal ends the job instead),
        hold the next master port (a fresh one, or the one the cluster file sets), and tell every
        node to start (Restart). (the Restart, None) or (None, why the job ends here)."""
        run = self.run
        attempt = run.attempt + 1
        deadline = run.clock() + policy.restart_delay(attempt, run.spec.restart_delay)
        while run.clock() < deadline:
            if isinstance(run.next_event(deadline), events.Stop):
                return None, decide.STOPPED_WAITING
        try:  # held until the launcher starts, as for the first attempt
            run.held = PortHold(run.spec.check_port or 0)
        except OSError as e:
            return None, "master port %s not free for attempt %d (%s)" % (run.spec.check_port, attempt, e.strerror)
        port = run.held.port
        return run.supervisor.restart(attempt, port), None

    def await_restart(self):
        """Every other node, between two attempts: the supervisor's word (bounded: a supervisor
        unheard for orphan_timeout is a stop, see PeerLink.beat). (the Restart, None), or (None,
        why it was stopped for good while it waited, or None: the job ended otherwise)."""
        run = self.run
        while True:
            event = run.events.get()
            if isinstance(event, events.Restart) and event.frame.nodes is not None \
                    and run.spec.node not in event.frame.nodes:
                self.left_out(event.frame.attempt)  # an elastic job goes on without this node: it waits
            elif isinstance(event, events.Restart):
                return event.frame, None
            if isinstance(event, (events.Over, events.Stop)):
                run.link.close()
                if isinstance(event, events.Stop):
                    return None, "%s while it waited to restart" % event.reason
                return None, (event.reason if event.reason == decide.STOPPED_WAITING else None)

    def left_out(self, attempt):
        """An elastic job's attempt ``attempt`` runs without this node (it was lost): recorded,
        and this node's agent waits to be taken back (or for the job's end)."""
        run = self.run
        run.record.update(state="away", reason="attempt %d runs without this node; it waits to be taken back" % attempt)
        write_record(run.dir, run.record)

    def begin(self, restart):
        """Start attempt ``restart.attempt`` here: the launch line of the first with the new
        master port (and an elastic job's shape), its own journal and torchrun log directory,
        DDP_UP_ATTEMPT its number."""
        run = self.run
        run.attempt, run.next_go = restart.attempt, None
        run.log_dir = os.path.join(run.dir, per_attempt("logs", run.attempt))
        go = run.first_go
        run.close_listener()
        argv = with_port(go.argv, restart.port)
        if restart.nodes is not None:
            shape = place(run.spec.sizes, restart.nodes, run.spec.node)
            argv, run.ranks = relaid(argv, shape), [shape[1], run.spec.sizes[run.spec.node]]
        run.start(wire.Go(argv=argv, supervisor=go.supervisor, env=go.env))
        run.out.last_output = run.clock()
        run.record.update(state="running", attempt=run.attempt, ended=None, code=None, reason=None,
                           master=master_of(argv), ranks=run.ranks)
        write_record(run.dir, run.record)
        if run.supervisor is not None:
            run.supervisor.report(run.spec.node, "running", attempt=run.attempt)
        else:
            run.link.rejoin(run.attempt)
