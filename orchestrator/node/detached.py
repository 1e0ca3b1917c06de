"""A detached job's run (``RunSpec.detach``): it goes on without the controller.

After Go, the job's record says it runs, its journal keeps every frame, and its agents watch each
other: the master node's agent is the job's supervisor, every other node's agent joins it (TCP,
each connection proving it knows the job's token). A closed controller connection or a SIGHUP (a
terminal closing) no longer stops the job.

The detached job's states, as its records show them (ddp-ls) and its supervisor drives them::

    running --every node ended, restart decided--> restarting --delay, Restart to every node--> running
       |                                               |
       +--every node ended, no restart--> done | failed | stopped      (outcome.json on the master)
                                                       ^
    restarting --a signal to the master's agent, ddp-kill--+
    running/restarting, agent gone without its record (SIGKILL, reboot) --> lost  (read, never written)

The first node to fail, stop or fall silent for orphan_timeout halts every node, as the controller
does for a job it watches; the decisions are decide.py's, pure.
"""

import os
import signal
import time

from . import decide, events, policy, wire
from .checks import PortHold
from .notify import JobNotices
from .inventory import remove_stale_state
from .relay import masked
from .run import Runner
from .state import BARS, JOURNAL, Journal, per_attempt, write_record
from .supervisor import PeerLink, Supervisor, listen_for_peers


def with_port(argv, port):
    """The launch line with another master port: the launcher's ``--master-port=N`` (both take it
    so), which comes before the script; the script's own arguments are left as they are."""
    at = next(i for i, a in enumerate(argv) if a.startswith("--master-port="))
    return argv[:at] + ["--master-port=%d" % port] + argv[at + 1:]


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


class DetachedRun(Runner):
    """The run with the detached job's hooks: its supervisor or link, journal, record, restarts."""
    warm_before_ready = True  # every node's ranks start together (run.await_warm)

    def __init__(self, spec, writer, clock=time.monotonic):
        Runner.__init__(self, spec, writer, clock)
        self.supervisor = None  # the master node: the Supervisor the other nodes join
        self.link = None  # the other nodes: their PeerLink to it
        self.record = None  # this node's record (see write_record), once the job runs on its own
        self.first_go = None  # attempt 0's Go, whose launch line every later attempt reuses
        self.next_go = None  # the Restart of the attempt to start next, between two attempts
        self.draft = None  # the record, written before the job starts; self.record once it runs on its own
        self.notices = JobNotices(spec, writer)  # the user's webhook and command targets (node/notify.py)

    def prepare(self):
        if not (self.spec.check_port or self.spec.pick_port):
            return None  # not the master node: this node's agent joins the supervisor at Go
        self.supervisor = Supervisor(self, listen_for_peers(self.spec.master_addr))
        return self.supervisor.port

    def check_go(self, go):
        if not (self.supervisor or go.supervisor):
            return "protocol error from the controller: a detached Go without its supervisor"
        return None

    def before_start(self, go):
        self.out.secrets = tuple(sorted(self.spec.secrets or (), key=len, reverse=True))
        self.out.begun, self.out.first_rank = set(), (self.spec.ranks or [0])[0]  # this attempt's start-up
        if self.out.journal is not None:
            self.out.journal.close()  # the attempt before's is complete
        self.out.journal = Journal(os.path.join(self.dir, per_attempt(JOURNAL, self.attempt)),
                                   os.path.join(self.dir, per_attempt(BARS, self.attempt)))
        if self.draft is None:  # written before Started goes out: once ddp-up says the job runs, ddp-attach finds it
            self.draft = self.new_record(go)
            write_record(self.dir, self.draft)

    def new_record(self, go):
        return {"job": self.spec.job, "node": self.spec.node, "label": self.spec.label, "script": self.spec.script,
                "ranks": self.spec.ranks, "pid": os.getpid(), "started": time.time(), "ended": None,
                "state": "running", "code": None, "reason": None, "retention": self.spec.retention,
                "attempt": self.attempt, "master": master_of(go.argv), "commit": self.spec.commit}

    def waiting(self):
        """This node's ranks (global) that have not begun: the supervisor's start-up watch."""
        first, count = self.spec.ranks or (0, 0)
        return [first + rank for rank in range(count) if rank not in (self.out.begun or ())]

    def ranks_ended(self):
        """Every rank here has ended while the launcher finishes: its silence is no hang."""
        ends = self.launch.rank_ends if self.launch is not None else None
        return ends is not None and ends.all_ended()

    def on_its_own(self):
        return self.record is not None

    def controller_gone(self, event):
        if not self.on_its_own():
            return Runner.controller_gone(self, event)
        self.out.broken = True  # the point of detaching
        return None

    def controller_silent(self, silent):
        if not self.on_its_own():
            return Runner.controller_silent(self, silent)
        self.out.broken = True  # a partitioned controller: its stream would block, the journal has it all
        return None

    def keeps_logs(self):
        return True

    def arrived(self, frame):
        """This node's Arrivals, to the supervisor's straggler watch (the master node's own, or over
        the link: never blocking the writer long, as PeerLink.send takes a lock, not a wait)."""
        if self.supervisor is not None:
            self.supervisor.arrived(self.spec.node, frame)
        elif self.link is not None:
            self.link.send(frame)

    def stop(self, reason, force, by=None):
        if by == "signal":  # anyone's but ddp-kill's (ddp-up, attached, sends this event itself)
            self.signalled(reason)
        return Runner.stop(self, reason, force, by)

    def signalled(self, reason):
        self.notices.send("signal", "job %s: %s (node %d) %s: its part stops, and with it the job" % (
            self.spec.job, self.spec.label, self.spec.node, reason), signal=reason.rpartition(" ")[2],
            node=self.spec.node, host=self.spec.label)

    def run_job(self, go):
        self.start(go)
        self.detach(go)
        while True:
            code = self.supervise()
            if self.next_go is None:
                self.notices.deliveries.wait()  # bounded: a target's send never holds the node past it
                return code
            self.begin_attempt(self.next_go)

    def detach(self, go):
        """From now on the job needs no controller."""
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        self.out.peers = self.arrived
        self.out.last_output = self.clock()  # the hang watch counts from the start, as ddp-up's does
        self.first_go = go
        self.record = self.draft
        try:
            remove_stale_state({}, records_only=True)  # finished detached jobs past their retention, here
        except OSError:
            pass  # housekeeping: nothing in another job's state may keep this one from being supervised
        if self.supervisor is not None:
            self.supervisor.start()
            self.supervisor.report(self.spec.node, "running")
        else:
            addr, port = go.supervisor
            self.link = PeerLink(self, addr, int(port))
            self.link.start()

    def after_exit(self, code, stopped, reason, failures, ends):
        """Record how the attempt ended here and tell the supervisor (a node whose ranks failed by
        themselves failed, stopped or not, with its earliest failure's own time and exception). The master node's agent
        then waits for every node's end (or loss) and decides: the next attempt (restarts left,
        every node still heard, no one stopped it for good) after its delay, or the job's end,
        recorded. Every other node waits for that word while restarts are left."""
        state = policy.node_end(bool(failures), stopped, code)
        rank_code = self.launch.report.rank_code() if state == "failed" else None  # the rank's own, as ddp-up reads it
        code = code if rank_code is None else rank_code  # torchrun's is 1 for any rank; no_restart_on_exit reads the rank's
        failure = own_failure(failures, ends, (self.spec.ranks or [0])[0]) if state == "failed" else None
        failure = masked(failure, self.out.secrets)  # for the supervisor's outcome, which ddp-ls shows
        more = self.attempt < self.spec.restarts + self.spec.recoveries and not self.for_good  # may restart
        self.record.update(ended=time.time(), state="restarting" if more else state, code=code, reason=reason)
        write_record(self.dir, self.record)
        go, stopped_waiting = None, None
        if self.supervisor is not None:
            self.supervisor.report(self.spec.node, state, code, reason, self.attempt, self.for_good, failure)
            self.supervisor.finished.wait()
            if not self.supervisor.over_event.is_set():
                go, why = self.restart_here()
                if go is None:
                    self.supervisor.over(why)
                    stopped_waiting = why if why == decide.STOPPED_WAITING else None
        elif self.link is not None:
            self.link.report(state, code, reason, self.attempt, self.for_good, failure, keep=more)
            go, stopped_waiting = self.await_restart() if more else (None, None)
        if go is None and more:  # a stop while it waited to restart ends the job stopped, not failed
            self.record.update(state="stopped" if stopped_waiting else state, reason=stopped_waiting or reason)
            write_record(self.dir, self.record)
        self.next_go = go
        return go is not None

    def restart_here(self):
        """The master node, between two attempts: wait the delay (a signal ends the job instead),
        hold the next master port (a fresh one, or the one the cluster file sets), and tell every
        node to start (Restart). (the Restart, None) or (None, why the job ends here)."""
        attempt = self.attempt + 1
        deadline = self.clock() + policy.restart_delay(attempt, self.spec.restart_delay)
        while self.clock() < deadline:
            if isinstance(self.next_event(deadline), events.Stop):
                return None, decide.STOPPED_WAITING
        try:  # held until the launcher starts, as for the first attempt
            self.held = PortHold(self.spec.check_port or 0)
        except OSError as e:
            return None, "master port %s not free for attempt %d (%s)" % (self.spec.check_port, attempt, e.strerror)
        port = self.held.port
        self.supervisor.restart(attempt, port)
        return wire.Restart(attempt=attempt, port=port), None

    def await_restart(self):
        """Every other node, between two attempts: the supervisor's word (bounded: a supervisor
        unheard for orphan_timeout is a stop, see PeerLink.beat). (the Restart, None), or (None,
        why it was stopped for good while it waited, or None: the job ended otherwise)."""
        while True:
            event = self.events.get()
            if isinstance(event, events.Restart):
                return event.frame, None
            if isinstance(event, (events.Over, events.Stop)):
                self.link.close()
                if isinstance(event, events.Stop):
                    return None, "%s while it waited to restart" % event.reason
                return None, (event.reason if event.reason == decide.STOPPED_WAITING else None)

    def begin_attempt(self, restart):
        """Start attempt ``restart.attempt`` here: the launch line of the first with the new
        master port, its own journal and torchrun log directory, DDP_UP_ATTEMPT its number."""
        self.attempt, self.next_go = restart.attempt, None
        self.log_dir = os.path.join(self.dir, per_attempt("logs", self.attempt))
        go = self.first_go
        self.close_listener()
        argv = with_port(go.argv, restart.port)
        self.start(wire.Go(argv=argv, supervisor=go.supervisor, env=go.env))
        self.out.last_output = self.clock()
        self.record.update(state="running", attempt=self.attempt, ended=None, code=None, reason=None,
                           master=master_of(argv))
        write_record(self.dir, self.record)
        if self.supervisor is not None:
            self.supervisor.report(self.spec.node, "running", attempt=self.attempt)
        else:
            self.link.rejoin(self.attempt)


def run_mode(spec, writer):
    """Run mode: the job detached (a DetachedRun) or with the controller watching (a Runner)."""
    return (DetachedRun if spec.detach else Runner)(spec, writer).run()
