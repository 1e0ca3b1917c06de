"""One attempt's processes on this node: the launcher (or, for ``launcher: none``, the workers
themselves), their output relayed to the controller, GPU samples, stack dumps, and their end.

Every process it starts carries the launch's tags (procs.py) and runs in a session of its own,
so ending it (``end``) reaches all of them, and nothing else.
"""

import math
import os
import signal
import subprocess
import sys
import threading
import time

from . import container, events, facts, flight, policy, wire
from .checks import CALL_HOOK, job_env
from .failures import RankEnds, rank_failures
from .keptbox import BoxLauncher, BoxWarm
from .procs import (JOB_SIGNALS, KILL_WAIT, TAG_ATTEMPT, TAGS, TORCHRUN, WARM_MARK, carries, find_tagged, is_launcher, kill_tagged, read_tags,
                    signal_name, signal_ranks, signal_tagged, spec_tags, wait_gone)
from .relay import Tailer, join_while_moving, pump
from .report import ReportReader
from .results import call_results
from .stacks import dump_all, sitecustomize
from .teardown import TEARDOWN, died_in_teardown, ended_scripts, hooks_dir, scripts_ended
from .state import per_attempt, private_dir, remove_quietly, write_private
from .workers import OWN_LAUNCHER, Workers, parse_launch
from .warm import attempt_files, fork_torchrun

SHUTDOWN_TIMEOUT = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"  # torchrun's --shutdown-timeout, read by torchrun and torch.distributed.launch
TORCHRUN_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")  # what torchrun passes on to its ranks by default


def torchrun_passes_on(stop_signal):
    """The signals torchrun passes on to its workers in a job that stops with ``stop_signal``:
    its own, and that one (plan.launch tells torchrun with --signals-to-handle)."""
    return tuple(dict.fromkeys(TORCHRUN_SIGNALS + (stop_signal,)))


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
ACCELERATE_NODE_OPTIONS = "--ddp-up-node-options"
# Rich (Lightning's default bar where rich is installed) draws live only on what it takes for an
# interactive terminal; a rank's output is a file, so it drew once, at the end. These make it draw
# as on a terminal (\r, erase, colors), which the node's Screen reads as a terminal does. COLUMNS:
# a wide terminal's width (80 in a file), for what fills it (a Panel, a logging handler's lines,
# argparse's help). While its bar is live, Rich prints the rank's own lines itself: the rank's hook
# has them printed whole, not folded at that width, and its stderr kept stderr (stacks.RICH_AT_FORK).
# tqdm reads COLUMNS only with LINES, and takes no width from it here. A job that sets any of these
# keeps its own value.
TERMINAL_ENV = {"TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1", "COLUMNS": "200"}


def accelerate_options(argv, env, log_dir, stop_signal):
    """`launcher: accelerate`: the Go's argv with this node's options for `accelerate launch`, and
    ``env`` completed. accelerate passes its own --log_dir (None unless given) to torchrun over
    torchrun's PET_LOG_DIR, so it is given; torchrun's other settings come through PET_ variables
    (its per-rank log files, the stop signals). Without a config file (--config_file, or
    accelerate's default one on this node), --multi_gpu: else one GPU a node runs alone. A node
    without GPUs sets ACCELERATE_USE_CPU: else every rank trains by itself."""
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    configured = any(a.startswith("--config_file") for a in argv) or \
        os.path.isfile(os.path.join(os.path.expanduser(home), "accelerate", "default_config.yaml"))
    env.setdefault("PET_REDIRECTS", "3")
    if stop_signal not in TORCHRUN_SIGNALS:  # as plan.LaunchPlan._signals tells torchrun itself
        env.setdefault("PET_SIGNALS_TO_HANDLE", ",".join((*TORCHRUN_SIGNALS, stop_signal)))
    if not facts.has_nvidia_gpus():
        env.setdefault("ACCELERATE_USE_CPU", "true")
    return with_node_options(argv, ["--log_dir=" + log_dir] + ([] if configured else unconfigured_options(env)))


def with_node_options(argv, options):
    """The `accelerate launch` line with ``options`` where the plan left ACCELERATE_NODE_OPTIONS."""
    i = argv.index(ACCELERATE_NODE_OPTIONS)
    return argv[:i] + options + argv[i + 1:]


def unconfigured_options(env):
    """`accelerate launch`'s options on a node without an accelerate config: --multi_gpu, and the
    two values it otherwise warns it took defaults for, every node every run (the job's own
    ACCELERATE_MIXED_PRECISION and ACCELERATE_DYNAMO_BACKEND where it sets them)."""
    return ["--multi_gpu", "--mixed_precision=" + env.get("ACCELERATE_MIXED_PRECISION", "no"),
            "--dynamo_backend=" + env.get("ACCELERATE_DYNAMO_BACKEND", "no")]


def results_of(launch):
    """A function's launch: the Result frame of each rank of ``launch`` that returned (call_results)."""
    spec = launch.spec
    if CALL_HOOK not in (spec.hooks or {}) or spec.detach:  # a detached job has no caller
        return []
    return call_results(hooks_dir(launch.dir, launch.attempt), spec.nproc or 1)


def runs_torchrun(argv):
    """Whether ``argv`` is the plan's torchrun line, ``PYTHON -u -m torch.distributed.run ...``: the
    one a warm interpreter forks (its ``-m ...`` part), on the host or in a container."""
    return argv[1:4] == ["-u", "-m", TORCHRUN]


def warm_here(spec):
    """Whether this node's ranks are forked warm, as the spec says (plan.launch.warms): not where
    it asks for GPUs that this node has none of (ddp-check --gpus, whose probe needs no torch there)."""
    return bool(spec.warm) and not (spec.warm_gpus_only and not facts.has_nvidia_gpus())


def warm_in_box(spec, state_dir, attempt, argv):
    """boxwarm's arguments where the launcher (torchrun, or ddp-up's own) starts from a warm
    interpreter in the container (its socket and log in the node's state directory, bound at the
    same path inside), else None. The signals it passes on: torchrun's, or all a job may be sent,
    as workers.main passes them on in a cold container."""
    own = argv[0] == OWN_LAUNCHER
    if not warm_here(spec) or not (own or runs_torchrun(argv)):
        return None
    passed = JOB_SIGNALS if own else torchrun_passes_on(spec.stop_signal)
    return [*attempt_files(state_dir, attempt), ",".join(spec.preload or ()), ",".join(passed),
            str(spec.nproc or 1), hooks_dir(state_dir, attempt)]


def started_launcher(argv, env, warm=None, stop_signal="SIGTERM"):
    """The launcher's process (a Popen, or a warm.WarmChild) and the read ends of its stdout and
    stderr, ours to close. torchrun is forked from the warm interpreter where there is one: it then
    starts without importing torch, and its workers (zygote.WARM_STUB) ask that interpreter too."""
    if warm is not None and runs_torchrun(argv):
        passed = ",".join(torchrun_passes_on(stop_signal))  # what the stand-ins pass on to their ranks
        started = with_pipes(lambda fds: fork_torchrun(warm, argv, env, passed, fds))
        if started is not None:
            return started
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    pipes = tuple(os.dup(pipe.fileno()) for pipe in (proc.stdout, proc.stderr))
    proc.stdout.close(), proc.stderr.close()
    return proc, pipes


def with_pipes(start):
    """(what ``start(fds)`` started, with the write ends of two new pipes as its stdout and stderr,
    and /dev/null as its stdin: they go with its request, so its child has them when it starts;
    the read ends, ours to close), or None where it started nothing."""
    (out_r, out_w), (err_r, err_w), null = os.pipe(), os.pipe(), os.open(os.devnull, os.O_RDONLY)
    try:
        child = start([null, out_w, err_w])
    finally:
        os.close(out_w), os.close(err_w), os.close(null)
    if child is None:
        os.close(out_r), os.close(err_r)
        return None
    return child, (out_r, err_r)


def started_in_kept_box(warm, argv, inner, stop_signal):
    """The launcher ``argv`` forked in the kept container of the run or of the Python session
    (keptbox.py, ``warm``), with ``inner`` over the container's own environment, as an attempt's
    env file sets it: (its BoxLauncher, the read ends of its stdout and stderr), or None (the
    attempt then runs in a container of its own)."""
    if not (argv[0] == OWN_LAUNCHER or runs_torchrun(argv)):
        return None
    passed = ",".join(torchrun_passes_on(stop_signal))
    return with_pipes(lambda fds: warm.launch(argv, inner, fds, passed))


def own_vars(spec, go_env):
    """The variables a container always gets from the job's environment (container.inner_env)."""
    return set(spec.env or ()) | set(go_env) | set(TAGS) | {"PET_LOG_DIR", SHUTDOWN_TIMEOUT, *TERMINAL_ENV}


def write_hooks(state_dir, attempt, files):
    """Files of ours the job runs (the dump hook, ddp-check's probe), {name: text}, in this
    node's state directory; that directory, for the job's PYTHONPATH."""
    hooks = hooks_dir(state_dir, attempt)
    try:
        os.mkdir(hooks, 0o700)
    except FileExistsError:
        pass
    for name, text in files.items():
        write_private(os.path.join(hooks, os.path.basename(name)), text)  # a name, never a path
    return hooks


def record_collectives(env, state_dir, attempt, torch_version):
    """Turn the Flight Recorder on in ``env`` (where the job did not set it) with a private
    directory for the ranks' records: that directory, or None where there can be none here."""
    path = os.path.join(state_dir, per_attempt("flight", attempt))
    if private_dir(path) is not None:
        return None
    flight.recording_env(env, path, torch_version)
    return path


class Launch:
    """Attempt ``attempt`` of the job here, from its Go: started, watched, signalled, ended. Its
    exit goes on ``post`` as an events.Exited of this attempt (a later one's is told apart)."""

    def __init__(self, spec, out, match, state_dir, log_dir, attempt, job_env, post, box=None, torch=None):
        self.spec, self.out, self.match = spec, out, dict(match, **{TAG_ATTEMPT: str(attempt)})  # this attempt's alone
        self.dir, self.log_dir, self.attempt = state_dir, log_dir, attempt
        self.job_env, self.post = job_env, post  # the job's environment (a dict, copied), the agent's queue
        self.proc = None
        self.pumps, self.tailer = [], None
        self.ended = threading.Event()  # the job is over here: samplers stop
        self.stop_wall = None  # when it was asked to stop (wall clock)
        self.rank_ends = None  # the launcher's workers' ends (failures.RankEnds)
        self.ends = {}  # {local rank: when it ended}, once the launch is over
        self.killed = 0  # how many of its processes (launchers aside) were still there at its end, and got SIGKILL
        self.flight_dir = None  # where the ranks write their Flight Recorder records (flight.py), if they do
        self.box = box  # the container the launcher runs in (container.Box), if the job has one
        self.env_file = None  # the job's environment for the container's first process (container.LOADER)
        self.go_env = {}  # what the Go adds to the job's environment (the network interfaces)
        self.torch_version = (torch or {}).get("torch")  # the job's torch, as the preflight read it
        self.report = ReportReader()  # the launcher's failure report: each failed rank's own exit code

    def start(self, go, warm=None):  # warm: the interpreter its ranks are forked from (warm.Warm), if any
        env = self.launch_env(go)
        self.out.launcher = self.report.feed
        if go.argv[0] == OWN_LAUNCHER and self.box is None:
            self.proc = Workers(parse_launch(go.argv[1:]), env, self.match,
                                lambda text: self.out.send(wire.Output("err", None, text.encode())), warm)
            self.proc.start(self.log_dir)
            self.out.send(wire.Started())
            markers, ends = (lambda: ended_scripts(self.dir, self.attempt)), (lambda: list(self.proc.ends))
            threading.Thread(target=scripts_ended, name="scripts-ended", daemon=True,
                             args=(self.ended, markers, ends, int(self.proc.opts["first-rank"]),
                                   int(self.proc.opts["nproc-per-node"]), lambda: self.out.send(wire.RanksEnded()))).start()
        else:
            self.start_launcher(go.argv, env, warm)
        self.tailer = Tailer(self.log_dir, self.out)
        self.tailer.start()
        if facts.has_nvidia_gpus():
            threading.Thread(target=sample_gpus, args=(self.ended, self.out), name="gpus", daemon=True).start()
        if self.flight_dir is not None:
            threading.Thread(target=flight.watch, args=(self.ended, self.out, self.flight_dir, self.spec.nproc),
                             name="collectives", daemon=True).start()
        proc, attempt = self.proc, self.attempt
        threading.Thread(target=lambda: self.post(events.Exited(attempt, proc.wait())), daemon=True).start()

    def launch_env(self, go):
        """The launcher's environment: the job's, the Go's, the tags, and the hooks on its path."""
        env = dict(TERMINAL_ENV, **self.job_env())  # the job's own settings win
        self.go_env = go.env or {}
        env.update(self.go_env)
        env.update(spec_tags(self.spec, self.attempt))
        env["PET_LOG_DIR"] = self.log_dir  # torchrun --log-dir, kept out of the user's workdir
        # torchrun's own wait between its SIGTERM to the ranks and SIGKILL (30 s unless told): the
        # ranks get the whole stop_grace to save their work, not torchrun's default
        env.setdefault(SHUTDOWN_TIMEOUT, str(int(math.ceil(self.spec.stop_grace))))
        hooks = dict(self.spec.hooks or {})
        if self.spec.flight_recorder:
            self.flight_dir = record_collectives(env, self.dir, self.attempt, self.torch_version)
        recorder = self.flight_dir is not None
        # always: besides the stack dumps and the recorder, it tells a rank's clean end (stacks.END_WATCH)
        hooks["sitecustomize.py"] = sitecustomize(self.spec.stack_dumps, flight.RECORDER_HOOK if recorder else "")
        where = write_hooks(self.dir, self.attempt, hooks)
        env["PYTHONPATH"] = where + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        return env

    def start_launcher(self, argv, env, warm=None):
        # The plan names the node's python as configured (``~/venv/bin/python``, ``python3``); this
        # agent runs under exactly that interpreter, already resolved by the shell that started it.
        if ACCELERATE_NODE_OPTIONS in argv:
            argv = accelerate_options(argv, env, self.log_dir, self.spec.stop_signal)
        started = self.in_kept_box(argv, env, warm) if isinstance(warm, BoxWarm) else None  # (a job in a container)
        if started is None:
            if self.box is not None:
                argv, env, warm = *self.in_container(argv, env), None
            else:
                argv = [sys.executable if a == argv[0] else a for a in argv]
            started = started_launcher(argv, env, warm, self.spec.stop_signal)
        self.proc, pipes = started
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

    def in_container(self, argv, env):
        """(the runtime client's argv, its environment): the launcher in this attempt's container,
        the job's environment in a private file, never on a command line (Box.start_args)."""
        self.env_file = os.path.join(self.dir, per_attempt(container.ENV_FILE, self.attempt))
        return self.box.start_args(argv, env, job_env(None), own_vars(self.spec, self.go_env), self.env_file, self.spec.box_code,
                                   warm_in_box(self.spec, self.dir, self.attempt, argv))

    def in_kept_box(self, argv, env, warm):
        """started_in_kept_box, with what the job's environment sets over the container's own."""
        inner = container.inner_env(env, job_env(None), own_vars(self.spec, self.go_env), self.box.gpus)
        started = started_in_kept_box(warm, argv, inner, self.spec.stop_signal)
        if started is not None:
            self.box = None  # no container of the attempt's own: none to signal or remove by its name
        return started

    def answer(self, event):
        """What the job's processes are asked while they run: their stacks (events.Dump), or a
        signal passed on to every rank (events.PassOn), straight: the launcher would stop on it."""
        if isinstance(event, events.Dump):
            print_as = lambda local, text: self.tailer.send("err", local, flight.without_recorder(text))  # noqa: E731
            threading.Thread(target=dump_stacks, name="dump", daemon=True,  # heartbeats go on while py-spy attaches
                             args=(self.match, self.job_env().get("PATH"), print_as, self.flight_dir, self.out)).start()
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
        elif self.box is not None and self.box.signal(signal.Signals(sig).name):
            pass  # the container's first process is the launcher; its client only waits for it
        elif self.proc and self.proc.poll() is None:
            signal_tagged(self.proc.pid, sig, self.match)

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
        if self.box is not None:
            self.box.remove()  # a daemon's container outlives its client: by name, SIGKILL and gone
        remove_quietly(self.env_file)
        send_collectives(self.flight_dir, self.out)  # a rank that died of a collective's timeout left its record
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
    node (stacks.END_WATCH), and none left an exception, ended the job's work: code 0, and the
    reason says so (torch's threads can abort the interpreter's teardown)."""
    code = launch.end(code)
    if launch.relay_died and not stopped:  # ranks' lines were lost: never an "ok"
        return code or 1, launch.relay_died, *launch.failures(stopped)
    failures, ends = launch.failures(stopped)
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
    apps = facts.parse_apps(facts.nvidia_smi(facts.APPS_QUERY))
    ours = [app for app in apps if carries(read_tags(app["pid"]), match)]
    return [facts.holder(app, app["uuid"], facts.process_owner) for app in ours] or None
