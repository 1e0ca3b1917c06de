"""Warm start in a container: the container's first process, after container.LOADER.

The agent stays on the host and the job's Python is in the image, so the node's warm interpreter
(warm.Warm, userpython/warmparent.py) has to start inside the container: this small launcher starts it there
and, once torch is imported, is what the launcher is in a cold container: the process the runtime
signals (``docker kill``, ``podman kill``), which passes each stop signal on, and ends with the
launcher's exit status.

- Under torchrun it forks torchrun from the interpreter and passes the signals on to it.
  torchrun's workers are the stand-ins of a warm start on the host (userpython/standin.py): they ask
  the interpreter on its socket in the node's state directory, bound into the container at the
  same path. Where the interpreter cannot fork (an import initialized CUDA, or the imports took
  longer than warm.READY_WAIT), its one notice goes to stderr and torchrun takes this process's
  place, as in a cold start: without the socket in their environment, the stand-ins start their
  ranks cold.
- Under `launcher: none` it is ddp-up's own launcher (workers.Workers), as workers.main is in a
  cold container, and each rank is forked from the interpreter (cold, one by one, where it cannot).

It runs from the package the agent writes beside the env file (container.BOX_PACKAGE), stdlib only:
    python -S -c BOX_MAIN%boxwarm PACKAGE SOCKET LOG PRELOAD PASS_ON NPROC HOOKS -- LAUNCHER...
where LAUNCHER is ``PYTHON -u -m torch.distributed.run ...`` or ``ddp-up-launch OPTIONS SCRIPT ARGS``.
"""

import os
import signal
import subprocess
import sys
import time

from ..local.procs import TAGS
from .warm import READY_WAIT, Warm, fork_torchrun
from .workers import OWN_LAUNCHER, Workers, parse_launch


def main(argv):
    sock, log, preload, passed, nproc, hooks, launcher = argv[0], argv[1], argv[2], argv[3], int(argv[4]), argv[5], argv[7:]
    for sig in (signal.SIGUSR1, signal.SIGUSR2):  # as the agent on the host (run.install_handlers): the ranks
        signal.signal(sig, signal.SIG_IGN)  # inherit it; ddp-up sends these to the ranks straight
    pending = []  # recorded here, acted on in the loops below: what torchrun would pass on to its workers
    for name in passed.split(","):
        signal.signal(getattr(signal, name), lambda sig, _frame: pending.append(sig))
    warm = Warm(sys.executable, interpreter_env(os.environ, hooks), os.getcwd(), log, [n for n in preload.split(",") if n],
                listen=sock, report=say, nproc=nproc)
    deadline = time.monotonic() + READY_WAIT
    while not pending and not warm.answered(0.1) and time.monotonic() < deadline:
        pass
    if pending:  # stopped before anything started: nothing to pass it on to
        warm.give_up()
        return 128 + pending[0]
    warm.patience = 0  # waited already: a fork now is taken or given up on at once
    child = start_in(warm, launcher, dict(os.environ), passed, [0, 1, 2], say)
    if child is None:  # torchrun, cold, in this process's place
        warm.reap()
        os.execvp(launcher[0], launcher)
    while True:
        try:
            code = child.wait(0.1)
            break
        except subprocess.TimeoutExpired:
            while pending:
                child.send_signal(pending.pop(0))
    warm.close()
    return code if code >= 0 else 128 - code  # as a shell reports a signal's end (this process may be pid 1)


def start_in(warm, launcher, env, passed, fds, report):
    """The launcher ``launcher`` here, from ``warm``, with the stdio ``fds`` and ``env``: torchrun
    forked from it (warm.fork_torchrun), or, under `launcher: none`, ddp-up's own launcher (workers.Workers) here, whose ranks are each forked from it (cold, one by one,
    where it cannot), its notices through ``report``. What it gives waits and takes signals like a
    Popen; None where torchrun cannot be forked (it then starts cold). ``passed``: the signals
    torchrun's stand-ins pass on to their ranks. Also the kept container's (boxkeep.py)."""
    if launcher[0] == OWN_LAUNCHER:
        workers = Workers(parse_launch(launcher[1:]), env, {k: env[k] for k in TAGS if k in env}, report, warm=warm)
        workers.start(env["PET_LOG_DIR"])  # then no more forks: an attempt's own interpreter ends after its ranks
        return workers
    return fork_torchrun(warm, launcher, env, passed, fds)


def interpreter_env(environ, hooks):
    """The job's environment less ddp-up's hooks on PYTHONPATH: the interpreter must not run the
    attempt's sitecustomize (its stack dumps, its Flight Recorder) as its own; each rank runs it
    once forked (inchild.repath), as the host's warm interpreter, started without them, has it."""
    env = dict(environ)
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != hooks]
    env.pop("PYTHONPATH", None)
    if path:
        env["PYTHONPATH"] = os.pathsep.join(path)
    return env


def say(text):
    sys.stderr.write(text)
    sys.stderr.flush()
