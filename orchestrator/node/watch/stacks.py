"""Every rank's Python stack on request (a job that looks hung), without changing the user's script.

With py-spy where the job's PATH has it (no hook needed, works on any frame); else a
sitecustomize first on the workers' PYTHONPATH (hooks: userpython/rankhook.py) has registered faulthandler for a
real-time signal (SIGUSR1 is often the application's own, e.g. for requeueing) and then loaded
any other sitecustomize on the path, and the agent sends that signal.
"""

import os
import shutil
import signal
import subprocess
import threading

from ..local.ourcode import source_of
from ..local.procs import catches, find_tagged, is_launcher, read_environ_value, signal_tagged
from ..userpython import rankhook
from ..userpython.rankhook import DUMPS_FILE

DUMP_SIGNAL = signal.SIGRTMIN + 7
PYSPY_TIMEOUT = 20.0  # seconds for one py-spy dump


def hooks(dumps):
    """The attempt's hook files, beside each other first on the launcher's PYTHONPATH: every rank's
    hook as its sitecustomize (userpython/rankhook.py: the end watch, Rich's lines, the Flight
    Recorder's thread where the job records, then whatever sitecustomize it shadows), and where
    ``dumps``, the stack dumps' signal it registers."""
    found = {"sitecustomize.py": source_of(rankhook)}
    if dumps:
        found[DUMPS_FILE] = str(int(DUMP_SIGNAL))
    return found


def workers_of(match):
    """(pid, rank, local rank) of every worker among the processes that carry ``match``."""
    found = []
    for proc in find_tagged(match):
        if is_launcher(proc):  # a warm rank's stand-in for torchrun (userpython/standin.py) carries its RANK too
            continue
        rank = read_environ_value(proc["pid"], b"RANK")
        local = read_environ_value(proc["pid"], b"LOCAL_RANK")
        if rank is not None and local is not None:
            found.append((proc["pid"], int(rank), int(local)))
    return found


def dump_all(match, path, print_as):
    """Ask every worker of ``match`` for its stack, at once; the ranks that gave one, sorted.
    ``print_as(local_rank, text)`` puts a py-spy dump into that rank's stderr stream, as if the
    worker printed it; ``path`` is the job's PATH, where py-spy is looked for."""
    pyspy = shutil.which("py-spy", path=path or os.defpath)
    results = {}

    def one(worker):
        results[worker] = dump_one(pyspy, match, print_as, *worker)
    threads = [threading.Thread(target=one, args=(w,), daemon=True) for w in workers_of(match)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(PYSPY_TIMEOUT + 5)
    return sorted(rank for (_, rank, _), ok in list(results.items()) if ok)


def dump_one(pyspy, match, print_as, pid, rank, local_rank):
    if pyspy:
        try:
            done = subprocess.run([pyspy, "dump", "--pid", str(pid)], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=PYSPY_TIMEOUT)
            if done.returncode == 0:
                text = b"ddp-up: py-spy dump of pid %d (rank %d)\n" % (pid, rank) + done.stdout.rstrip(b"\n")
                print_as(local_rank, text + b"\n")
                return True
        except (OSError, subprocess.SubprocessError):
            pass  # e.g. ptrace not allowed here: fall back to the hook
    return catches(pid, DUMP_SIGNAL) and signal_tagged(pid, DUMP_SIGNAL, match)
