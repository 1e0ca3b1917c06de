"""Where and with what an attempt's launcher starts: its environment (the job's, the Go's, the
tags, the attempt's hooks on its path), its place (here; in this attempt's container; in the warm
container kept across attempts; forked from the warm interpreter), and its command line's options
(torchrun's signals, Accelerate's node options). Placement gathers them for one attempt.
"""

import math
import os
import subprocess
import sys

from ..launchers import container
from ..launchers.keptbox import BoxWarm
from ..launchers.warm import attempt_files, fork_torchrun
from ..launchers.workers import OWN_LAUNCHER
from ..local.procs import JOB_SIGNALS, TAGS, TORCHRUN, job_env, spec_tags
from ..local.state import per_attempt, private_dir, remove_quietly, write_private
from ..probes import facts
from ..watch import flight
from ..watch.stacks import hooks as stack_hooks
from ..watch.teardown import hooks_dir


SHUTDOWN_TIMEOUT = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"  # torchrun's --shutdown-timeout, read by torchrun and torch.distributed.launch
TORCHRUN_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")  # what torchrun passes on to its ranks by default


def torchrun_passes_on(stop_signal):
    """The signals torchrun passes on to its workers in a job that stops with ``stop_signal``:
    its own, and that one (plan.launch tells torchrun with --signals-to-handle)."""
    return tuple(dict.fromkeys(TORCHRUN_SIGNALS + (stop_signal,)))


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
    starts without importing torch, and its workers (userpython/standin.py) ask that interpreter too."""
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


class Placement:
    """What attempt ``attempt``'s launcher gets, and where it runs: its environment (the job's, the
    Go's, the tags, and the attempt's hooks on its path), and its place: here, in this attempt's
    container (``box``), or in the warm container kept across attempts."""

    def __init__(self, spec, state_dir, log_dir, attempt, job_env, box=None, torch=None):
        self.spec, self.dir, self.log_dir, self.attempt, self.job_env = spec, state_dir, log_dir, attempt, job_env
        self.box = box  # the container the launcher runs in (container.Box), if the job has one
        self.env_file = None  # the job's environment for the container's first process (container.LOADER)
        self.go_env = {}  # what the Go adds to the job's environment (the network interfaces)
        self.flight_dir = None  # where the ranks write their Flight Recorder records (flight.py), if they do
        self.torch_version = (torch or {}).get("torch")  # the job's torch, as the preflight read it

    def env(self, go):
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
        else:
            env.pop(flight.DIR_VAR, None)  # the rank hook's recorder runs where this says so, only
        # always: besides the stack dumps and the recorder, it tells a rank's clean end (rankhook.watch_end)
        hooks.update(stack_hooks(self.spec.stack_dumps))
        where = write_hooks(self.dir, self.attempt, hooks)
        env["PYTHONPATH"] = where + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        return env

    def started(self, argv, env, warm=None):
        """(the launcher's process, its stdout and stderr pipes) once started in its place. The plan
        names the node's python as configured (``~/venv/bin/python``, ``python3``); this agent runs
        under exactly that interpreter, already resolved by the shell that started it."""
        if ACCELERATE_NODE_OPTIONS in argv:
            argv = accelerate_options(argv, env, self.log_dir, self.spec.stop_signal)
        started = self.in_kept_box(argv, env, warm) if isinstance(warm, BoxWarm) else None  # (a job in a container)
        if started is None:
            if self.box is not None:
                argv, env, warm = *self.in_container(argv, env), None
            else:
                argv = [sys.executable if a == argv[0] else a for a in argv]
            started = started_launcher(argv, env, warm, self.spec.stop_signal)
        return started

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

    def removed(self):
        """Its container (a daemon's outlives its client: by name, SIGKILL and gone) and the job's
        environment's file, once the attempt is over."""
        if self.box is not None:
            self.box.remove()
        remove_quietly(self.env_file)
