"""Keep mode: a warm interpreter (warm.Warm) kept ready on this node for every launch of one Python
session (orchestrator.launch called again), so that each one forks its ranks without importing
torch. The controller starts it once, through the same transport as an agent, and holds its
stdin: the keeper, and with it the interpreter (PR_SET_PDEATHSIG), ends when that closes (the
session's end, its Ctrl-C, its kill: the kernel closes the pipe or the connection), or when the
controller is silent for the spec's orphan_timeout, as every agent does.

Each launch's agent finds it by its name (RunSpec.keep) in this user's private state root
(warm.kept_dir) and asks on its socket: a hello first (ready, or cold and why), then one
connection per fork (warm.KeptWarm). It belongs to no job: no job's tags, so no job's cleanup
touches it; its own tag (TAG_KEEP) names it in /proc/PID/environ.
"""

import os
import re
import shutil
import socket
import sys
import threading
import time

from ..launchers.keptbox import HeldBox
from ..launchers.keptwarm import kept_dir
from ..launchers.warm import Warm
from ..local.procs import TAG_KEEP, job_env, kill_tagged
from ..local.state import private_dir, state_root, unsafe_state
from ..protocol import events, policy, wire
from .placement import TERMINAL_ENV, own_vars
from .run import install_handlers

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def keep(spec, writer):
    if not NAME.fullmatch(spec.name):
        writer.send(wire.Failed("a kept interpreter's name is letters, digits, '-' and '_'", "use one ddp-up version"))
        writer.drain(5)
        return 2
    where = kept_dir(spec.name)
    why = private_dir(state_root())
    if why is None:
        remove_stale(state_root())
        why = private_dir(where)
    if why:
        writer.send(unsafe_state(where, why))
        writer.drain(5)
        return 3
    ended = threading.Event()
    # as an agent's: a stop ends it (and its interpreter); SIGUSR1 and SIGUSR2 are ignored, here and
    # in the ranks forked from it, as a launch's (Slurm sends them to every process of every step)
    install_handlers(lambda *_: ended.set())
    try:
        warm = kept_interpreter(spec, where)
    except OSError as e:  # its container's runtime cannot be run: each launch finds none, and says so
        shutil.rmtree(where, ignore_errors=True)
        writer.send(wire.Kept(ready=False, why="%s; the ranks start cold" % e, seconds=None))
        writer.drain(5)
        return 3
    threading.Thread(target=tell_ready, args=(warm, writer), name="kept", daemon=True).start()
    try:
        hold(spec, warm, ended)
    finally:
        warm.reap()
        # what its imports started (a preload's helper process) carries its tag, as every job's
        # processes carry the job's: ended by the same rule, SIGTERM, a grace, then SIGKILL
        kill_tagged({TAG_KEEP: spec.name}, KEPT_GRACE)
        shutil.rmtree(where, ignore_errors=True)
    return 0


KEPT_GRACE = 5.0  # seconds what a kept interpreter started has, after SIGTERM, when it ends


def kept_interpreter(spec, where):
    """The interpreter kept in ``where``: on the node, or, where the job's Python is the image's,
    in a container kept for it (keptbox.py)."""
    if spec.container:
        return HeldBox(spec, {TAG_KEEP: spec.name}, interpreter_env(spec), where, own_vars(spec, {}) | {TAG_KEEP})
    workdir = os.path.expanduser(spec.workdir or "~")  # as a launch's agent runs (checks.check_paths)
    return Warm(sys.executable, interpreter_env(spec), workdir if os.path.isdir(workdir) else os.getcwd(),
                os.path.join(where, "log"), spec.preload or (),
                listen=os.path.join(where, "sock"), keep=True, nproc=spec.nproc or 1)


def interpreter_env(spec):
    """Its environment: the job's, as a launch's warm interpreter has it (run.warm_interpreter),
    with its own tag instead of a job's."""
    env = dict(TERMINAL_ENV, **job_env(spec.env))
    env[TAG_KEEP] = spec.name
    return env


def tell_ready(warm, writer):
    warm.answered(None)
    hello = warm.hello or {}
    writer.send(wire.Kept(ready="ready" in hello, why=warm.why_cold(), seconds=hello.get("seconds")))


def hold(spec, warm, ended, every=1.0):
    """Until the controller's stdin ends, it is silent too long, the interpreter is gone, or a
    signal stopped it (``ended``). The controller is read as every agent reads it."""
    heard = [time.monotonic()]

    def post(event):
        if isinstance(event, (events.ControllerGone, events.Stop)):
            ended.set()

    def hear():
        heard[0] = time.monotonic()

    threading.Thread(target=events.read_controller, args=(sys.stdin.buffer, post, hear), name="stdin", daemon=True).start()
    while not ended.wait(every):
        if policy.silence(time.monotonic(), heard[0], spec.orphan_timeout) is not None or warm.proc.poll() is not None:
            return


def remove_stale(root):
    """Kept interpreters' directories whose keeper was killed (nothing listens there): a keeper
    ends by removing its own, but SIGKILL ends it without."""
    for entry in os.listdir(root):
        path = os.path.join(root, entry)
        if not entry.startswith(".warm-") or private_dir(path, create=False):
            continue
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(os.path.join(path, "sock"))
        except (ConnectionRefusedError, FileNotFoundError):
            if os.path.lexists(os.path.join(path, "sock")):
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass
        finally:
            probe.close()
