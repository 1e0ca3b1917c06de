"""One attempt's processes on this node: the launcher (or, for ``launcher: none``, the workers
themselves), their output relayed to the controller, GPU samples, stack dumps, and their end.
Where and with what the launcher starts is placement.py's.

Every process it starts carries the launch's tags (procs.py) and runs in a session of its own,
so ending it (``end``) reaches all of them, and nothing else.
"""

import signal
import subprocess
import threading
import time

from ..launchers.keptbox import BoxLauncher
from ..launchers.workers import OWN_LAUNCHER, Workers, parse_launch
from ..local.procs import (KILL_WAIT, TAG_ATTEMPT, WARM_MARK, carries, find_tagged, is_launcher, kill_tagged,
                           ranks_by_number, read_environ_value, read_tags, signal_name, signal_ranks, signal_tagged,
                           wait_gone)
from ..probes import facts, smi
from ..protocol import events, policy, wire
from ..watch import flight
from ..watch.failures import RankEnds, rank_failures
from ..watch.relay import Tailer, join_while_moving, pump
from ..watch.report import ReportReader
from ..watch.results import call_results
from ..watch.stacks import dump_all
from ..watch.teardown import TEARDOWN, died_in_teardown, ended_scripts, hooks_dir, scripts_ended
from .checks import CALL_HOOK
from .placement import Placement

GPU_SAMPLE = 5.0  # seconds between GPU samples for the dashboard (its nvidia-smi query took 25 ms on an H200)


def sample_gpus(ended, out):
    """GPU use for the dashboard, every GPU_SAMPLE seconds until ``ended``: nvidia-smi on its own
    thread, and a sample dropped rather than queued behind the job's lines."""
    while not ended.wait(GPU_SAMPLE):
        usage = facts.query_usage()
        if usage and not ended.is_set():
            out.send(wire.GpuUsage(gpus=usage), block=False)


# `launcher: accelerate`: the word in the Go's argv where this node's own options for `accelerate
# launch` go (accelerate_options): where torchrun's per-rank logs are, and --multi_gpu unless the
# node has an accelerate config of its own.
def results_of(launch):
    """A function's launch: the Result frame of each rank of ``launch`` that returned (call_results)."""
    spec = launch.spec
    if CALL_HOOK not in (spec.hooks or {}) or spec.detach:  # a detached job has no caller
        return []
    return call_results(hooks_dir(launch.dir, launch.attempt), spec.nproc or 1)


class Launch:
    """Attempt ``attempt`` of the job here, from its Go: started in its place (Placement), watched,
    signalled, ended. Its exit goes on ``post`` as an events.Exited of this attempt (a later one's
    is told apart); how its ranks ended is its RankEnds' (ranks_done, ranks_died) and its logs'."""

    def __init__(self, spec, out, match, state_dir, log_dir, attempt, job_env, post, box=None, torch=None):
        self.spec, self.out, self.match = spec, out, dict(match, **{TAG_ATTEMPT: str(attempt)})  # this attempt's alone
        self.dir, self.log_dir, self.attempt = state_dir, log_dir, attempt
        self.job_env, self.post = job_env, post  # the job's environment (a dict, copied), the agent's queue
        self.place = Placement(spec, state_dir, log_dir, attempt, job_env, box, torch)
        self.proc = None
        self.pumps, self.tailer = [], None
        self.ended = threading.Event()  # the job is over here: samplers stop
        self.stop_wall = None  # when it was asked to stop (wall clock)
        self.rank_ends = None  # the launcher's workers' ends (failures.RankEnds)
        self.ends = {}  # {local rank: when it ended}, once the launch is over
        self.killed = 0  # how many of its processes (launchers aside) were still there at its end, and got SIGKILL
        self.report = ReportReader()  # the launcher's failure report: each failed rank's own exit code
        self.warm = None  # the interpreter its ranks were forked from, if any

    def start(self, go, warm=None):  # warm: the interpreter its ranks are forked from (warm.Warm), if any
        self.warm = warm
        env = self.place.env(go)
        self.out.launcher = self.report.feed
        if go.argv[0] == OWN_LAUNCHER and self.place.box is None:
            self.start_workers(go.argv, env, warm)
        else:
            self.start_launcher(go.argv, env, warm)
        self.tailer = Tailer(self.log_dir, self.out)
        self.tailer.start()
        if facts.has_nvidia_gpus():
            threading.Thread(target=sample_gpus, args=(self.ended, self.out), name="gpus", daemon=True).start()
        if self.place.flight_dir is not None:
            threading.Thread(target=flight.watch, args=(self.ended, self.out, self.place.flight_dir, self.spec.nproc),
                             name="collectives", daemon=True).start()
        proc, attempt = self.proc, self.attempt
        threading.Thread(target=lambda: self.post(events.Exited(attempt, proc.wait())), daemon=True).start()

    def start_workers(self, argv, env, warm):
        # `launcher: none`: the workers are this agent's own children, each rank's end its own to tell
        self.proc = Workers(parse_launch(argv[1:]), env, self.match,
                            lambda text: self.out.send(wire.Output("err", None, text.encode())), warm)
        self.proc.start(self.log_dir)
        self.out.send(wire.Started())
        markers, ends = (lambda: ended_scripts(self.dir, self.attempt)), (lambda: list(self.proc.ends))
        threading.Thread(target=scripts_ended, name="scripts-ended", daemon=True,
                         args=(self.ended, markers, ends, int(self.proc.opts["first-rank"]),
                               int(self.proc.opts["nproc-per-node"]), lambda: self.out.send(wire.RanksEnded()))).start()

    def start_launcher(self, argv, env, warm=None):
        self.proc, pipes = self.place.started(argv, env, warm)
        self.out.send(wire.Started())
        if self.proc.pid is not None:  # not a kept container's launcher: its pid is the container's
            self.rank_ends = RankEnds(self.proc.pid, self.match, self.spec.nproc or 1,
                                      lambda: self.out.send(wire.RanksEnded()),
                                      lambda: ended_scripts(self.dir, self.attempt))
            self.rank_ends.start()
        for fd, stream in zip(pipes, ("out", "err")):
            t = threading.Thread(target=pump, args=(fd, stream, self.out), daemon=True)
            t.start()
            self.pumps.append(t)

    def answer(self, event):
        """What the job's processes are asked while they run: their stacks (events.Dump), or a
        signal passed on to every rank (events.PassOn), straight: the launcher would stop on it."""
        if isinstance(event, events.Dump):
            print_as = lambda local, text: self.tailer.send("err", local, flight.without_recorder(text))  # noqa: E731
            threading.Thread(target=dump_stacks, name="dump", daemon=True,  # heartbeats go on while py-spy attaches
                             args=(self.match, self.job_env().get("PATH"), print_as, self.place.flight_dir, self.out)).start()
            return None
        sig = getattr(signal, event.name, None)
        if sig in policy.NOT_A_STOP:
            signal_ranks(sig, self.match)
        return None

    def signal(self, sig):
        """``sig`` to the launcher (or every worker), pinned by its tags: never a recycled pid.
        A stop: ranks that fail from here on fail of it, not by themselves."""
        if self.stop_wall is None:
            self.stop_wall = time.time()
        if isinstance(self.proc, (Workers, BoxLauncher)):  # the kept container's: through it
            self.proc.send_signal(sig)
        elif self.place.box is not None and self.place.box.signal(signal.Signals(sig).name):
            pass  # the container's first process is the launcher; its client only waits for it
        elif self.proc and self.proc.poll() is None:
            signal_tagged(self.proc.pid, sig, self.match)

    def end_stuck(self):
        """At a stop for a node lost: SIGKILL the ranks here whose Flight Recorder's last collective
        has not completed (it never will without that node, and a stop handler cannot run inside
        it: it would sit out stop_grace), each named with its collective. None: nothing left to do."""
        if self.place.flight_dir is None or self.place.box is not None:
            return None  # no record to read; in a container, its runtime ends what is left at the grace
        stuck = {rank: entries[-1] for rank, entries in flight.read_records(self.place.flight_dir).items()
                 if entries and entries[-1][4] is False}
        for rank, pids in ranks_by_number(find_tagged(self.match)).items() if stuck else ():
            entry = stuck.get(rank)
            for pid in pids if entry is not None else ():
                local = read_environ_value(pid, b"LOCAL_RANK") or ""  # the line is the rank's: shown
                if signal_tagged(pid, signal.SIGKILL, self.match):
                    self.out.send(wire.Output("err", int(local) if local.isdigit() else None, (
                        "ddp-up: rank %s was in %s #%s, which cannot complete without the node lost: ended now, "
                        "not waited for (stop_grace)\n" % (rank, entry[3], entry[2])).encode("utf-8", "replace")))
        return None

    def outlived(self, seconds):
        """In a stop, once the launcher has exited: post events.RanksGone when its processes that
        are still there (ranks still saving; torchrun gives up on a second SIGTERM, as under Slurm,
        where every process of the step gets it) have ended, at most ``seconds`` from now. They
        keep the whole grace: only what is left then is killed (end)."""
        # not the warm interpreter: it carries the attempt's tags and lives as long as this agent
        left = [p["pid"] for p in find_tagged(self.match) if WARM_MARK not in p["cmd"]]
        attempt = self.attempt

        def wait():
            wait_gone(left, seconds)
            self.post(events.RanksGone(attempt))

        threading.Thread(target=wait, name="outlived", daemon=True).start()

    def end(self, code):
        """SIGKILL whatever of the launch is left, then relay every line before the exit is told.
        The exit status: ``code``, or the launcher's own once it is reaped."""
        self.ended.set()
        if isinstance(self.proc, Workers):
            self.proc.ending()  # the SIGKILL below is ours: not a worker's failure to report
        found = kill_tagged(self.match, grace=0, first_signal=signal.SIGKILL)["found"]
        # what a stop cut short: the ranks (and what they started), not a launcher still tearing itself
        # down; torchrun's own SIGKILLs at the end of its wait are counted from its log (logparse.py)
        self.killed = sum(1 for p in found if not is_launcher(p))
        self.place.removed()
        send_collectives(self.place.flight_dir, self.out)  # a rank that died of a collective's timeout left its record
        if code is None and self.proc is not None:
            try:
                code = self.proc.wait(timeout=KILL_WAIT)
            except subprocess.TimeoutExpired:
                code = None
        self.ends = self.proc.ends if isinstance(self.proc, Workers) else (
            self.rank_ends.stop() if self.rank_ends is not None else {})
        # The job's processes are gone, so the pipes reach EOF and the log files are complete;
        # what bounds the wait is the controller reading (a stalled connection: orphan_timeout).
        stall = self.spec.orphan_timeout
        for t in self.pumps:
            join_while_moving(t, self.out, stall)  # stuck: a held pipe, or a dead connection
        if self.tailer is not None:
            self.tailer.finish(stall)
        return code

    def ranks_done(self):
        """Whether every rank of this attempt here has ended, each after a clean end of its script,
        while its launcher still runs (a torchrun at its exit barrier)."""
        ends = self.rank_ends
        return ends is not None and len(ends.ends) >= ends.count > 0 and not ends.died() and self.proc.poll() is None

    def ranks_died(self):
        """Whether a rank of this attempt here has ended without a clean end of its script (killed, or
        os._exit): its launcher may not have said so yet."""
        return self.rank_ends is not None and bool(self.rank_ends.died())

    @property
    def relay_died(self):
        """Why the relay of the ranks' output stopped, if it did (relay.Tailer.died)."""
        return self.tailer.died if self.tailer is not None else None

    def failures(self, stopped):
        """(what the ranks that failed by themselves left (failures.py), when each rank ended),
        for the Exited; if the attempt was stopped, only what came before the stop."""
        before = (self.stop_wall or time.time()) if stopped else float("inf")
        ends = {str(rank): at for rank, at in sorted(self.ends.items()) if at < before}
        return rank_failures(self.log_dir, before=before) or None, ends or None


def dump_stacks(match, path, print_as, flight_dir, out):
    """Every worker's Python stack into its stderr stream (``print_as``: a py-spy dump, less ddp-up's
    own thread), their last collectives, then Dumped."""
    ranks = dump_all(match, path, print_as)
    send_collectives(flight_dir, out)
    out.send(wire.Dumped(ranks=ranks))


def send_collectives(flight_dir, out):
    """Each rank's last collectives (Collectives), where the ranks recorded any."""
    records = flight.read_records(flight_dir) if flight_dir is not None else {}
    if records:
        out.send(flight.snapshot(records))


def outcome(launch, code, stopped, reason):
    """The end of ``launch`` (a Launch) here, for its Exited: (exit code, reason, failures, ends). A launcher
    that failed only because ranks died after their scripts ended cleanly, every rank of this
    node (rankhook's end watch), and none left an exception, ended the job's work: code 0, and the
    reason says so (torch's threads can abort the interpreter's teardown)."""
    code = launch.end(code)
    if launch.relay_died and not stopped:  # ranks' lines were lost: never an "ok"
        return code or 1, launch.relay_died, *launch.failures(stopped)
    failures, ends = launch.failures(stopped)
    died = getattr(launch.warm, "died", None)
    if code and not stopped and died:  # the ranks' own statuses went with their interpreter: said as it was
        return code, died, failures, ends
    every_rank_ended = len(ended_scripts(launch.dir, launch.attempt)) >= (launch.spec.nproc or 1)
    if code and not stopped and not failures and every_rank_ended and died_in_teardown(launch.report.parser):
        died = "was killed by %s" % signal_name(code) if signal_name(code) else "exited with code %d" % code
        launch.out.send(wire.Output("err", None, ("ddp-up: %s\n" % (TEARDOWN % died)).encode()))  # said, and logged
        return 0, TEARDOWN % died, None, ends
    return code, reason, failures, ends


def gpu_left(match):
    """The processes carrying ``match`` (a launch's tags) that still hold GPU memory once it is
    over (a process stuck in the driver survives SIGKILL): None where there are none, or no GPUs."""
    if not facts.has_nvidia_gpus():
        return None
    apps = facts.parse_apps(smi.nvidia_smi(facts.APPS_QUERY))
    ours = [app for app in apps if carries(read_tags(app["pid"]), match)]
    return [facts.holder(app, app["uuid"], facts.process_owner) for app in ours] or None
