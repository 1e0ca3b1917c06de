"""Every rank's Python stack on request (a job that looks hung), without changing the user's script.

With py-spy where the job's PATH has it (no hook needed, works on any frame); else a
sitecustomize first on the workers' PYTHONPATH (DUMP_HOOK) has registered faulthandler for a
real-time signal (SIGUSR1 is often the application's own, e.g. for requeueing) and then loaded
any other sitecustomize on the path, and the agent sends that signal.
"""

import os
import shutil
import signal
import subprocess
import threading

from .procs import catches, find_tagged, is_launcher, read_environ_value, signal_tagged

DUMP_SIGNAL = signal.SIGRTMIN + 7
PYSPY_TIMEOUT = 20.0  # seconds for one py-spy dump
HOOK_HEAD = "import faulthandler, importlib.machinery, importlib.util, os, sys\n"
DUMP_LINE = "faulthandler.register(%d, all_threads=True, chain=False)  # ddp-up: stack dump when a job looks hung\n" \
    % DUMP_SIGNAL
# A rank that ended its script cleanly (no uncaught exception, no exit with a failure) leaves
# ended.RANK beside this hook as it exits: a death after that, in the interpreter's teardown (torch's
# C++ threads at exit), is then not taken for the script's failure (launch.outcome). Every exit Python
# calls is watched: sys.exit, and the builtins exit() and quit() (site's Quitter, which raises
# SystemExit itself). A bare `raise SystemExit(3)` leaves no code to read here (CPython clears it
# before the atexit functions run), only a sign that the script did not run to its end
# (unseen_exit): no marker then. A warm rank's interpreter passes it through sys.exit (zygote), and the
# launcher's report of each rank's own code is checked as well (launch.outcome). Only the
# rank's own process: DDP_UP_RANK_PID tells its children (a DataLoader's workers) apart.
END_WATCH = """def _ddp_up_watch_end(where):
    if "RANK" not in os.environ or os.environ.get("DDP_UP_RANK_PID"):
        return  # not a rank (the launcher), or a rank's own child
    import atexit
    os.environ["DDP_UP_RANK_PID"], said, real_exit = str(os.getpid()), [], sys.exit
    def exit(status=None):
        said.append(status)
        real_exit(status)
    sys.exit = exit
    quitter = type(getattr(__import__("builtins"), "exit", None))
    if quitter.__module__ == "_sitebuiltins":  # exit() and quit(), as site made them
        real_call = quitter.__call__
        def call(self, code=None):
            said.append(code)
            real_call(self, code)
        quitter.__call__ = call
    def ended():
        status = said[-1] if said else None
        failed = not (status is None or (type(status) in (int, bool) and status == 0)) or \\
            hasattr(sys, "last_type") or hasattr(sys, "last_exc") or (not said and unseen_exit())
        if not failed and os.environ.get("RANK", "").isdigit():
            try:
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                os.close(os.open(os.path.join(where, "ended." + os.environ["RANK"]), flags, 0o600))
            except OSError:
                pass
    def unseen_exit():
        # A script (python SCRIPT) that ran to its end has its __main__.__file__ deleted before
        # the atexit functions run; one ended by an exception that went up, SystemExit among them,
        # keeps it (CPython 3.8 to 3.13 alike). Nothing said that code: it is no clean end.
        main = sys.modules.get("__main__")
        return main is not None and getattr(main, "__spec__", None) is None and "__file__" in vars(main)
    atexit.register(ended)
_ddp_up_watch_end(os.path.dirname(os.path.abspath(__file__)))
"""
# Rich's live display in a rank (Lightning's bar, drawn live there: launch.TERMINAL_ENV). Its
# redirected stdout keeps each line whole, and its stderr on stderr. A rank's forked children (a
# DataLoader's workers) under it (Lightning's bar, drawn
# live in ranks: launch.TERMINAL_ENV): a lock of Rich's that another thread held at the fork (its
# refresh thread, mid-refresh) is held for good in the child, where that thread is not, and the
# child's first print (through Rich's redirected stdout) waited for ever. In the child, each such
# lock is made anew; one this thread holds (a fork from inside a print) stays as it is.
RICH_AT_FORK = """def _ddp_up_rich_in_child():
    import threading
    consoles = [getattr(sys.modules.get("rich"), "_console", None)]
    for stream in (sys.stdout, sys.stderr):
        consoles.append(getattr(stream, "_FileProxy__console", None))
    for console in [c for c in consoles if c is not None]:
        lives = list(getattr(console, "_live_stack", None) or []) + [getattr(console, "_live", None)]
        for owner, name in [(console, "_lock"), (console, "_record_buffer_lock")] + [(l, "_lock") for l in lives if l]:
            lock = getattr(owner, name, None)
            if lock is None or not hasattr(lock, "acquire"):
                continue
            if lock.acquire(blocking=False):
                lock.release()
            else:
                setattr(owner, name, threading.RLock())
def _ddp_up_rich_lines(proxy):
    # Rich's redirected streams while its live display runs (a rank's bar, live as on a terminal:
    # launch.TERMINAL_ENV): a line goes whole, not folded at the console's width (a terminal wraps
    # it where it shows it), and what the rank writes to stderr stays on stderr, as by hand.
    if getattr(proxy, "_ddp_up", False):
        return
    real_write = proxy.write
    def write(self, text):
        if getattr(self, "rich_proxied_file", None) is sys.__stderr__ and sys.__stderr__ is not None:
            return sys.__stderr__.write(text)
        console = getattr(self, "_FileProxy__console", None)
        if console is None:
            return real_write(self, text)
        before, console.soft_wrap = console.soft_wrap, True  # (two threads at once: it may stay True, which
        try:  # keeps every line whole: no harm here)
            return real_write(self, text)
        finally:
            console.soft_wrap = before
    proxy.write, proxy._ddp_up = write, True
class _DdpUpRichWatch:  # on sys.meta_path: rich.file_proxy is patched as it is imported
    def find_spec(self, name, path=None, target=None):
        if name != "rich.file_proxy":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            real_exec = spec.loader.exec_module
            def exec_module(module):
                real_exec(module)
                try:
                    _ddp_up_rich_lines(module.FileProxy)
                except Exception:
                    pass  # Rich's insides changed: its own behaviour stands
            spec.loader.exec_module = exec_module
        return spec
if "RANK" in os.environ:
    if "rich.file_proxy" in sys.modules:  # a rank forked warm from an interpreter that imported Rich
        _ddp_up_rich_lines(sys.modules["rich.file_proxy"].FileProxy)
    else:
        sys.meta_path.insert(0, _DdpUpRichWatch())
def _ddp_up_after_fork():
    try:
        "rich" in sys.modules and _ddp_up_rich_in_child()
    except Exception:
        pass  # Rich's insides changed: the child goes on as it would have
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_ddp_up_after_fork)
"""
HOOK_CHAIN = """if not globals().get("_ddp_up_warm"):  # a rank forked warm: its interpreter ran the one we shadow
    _here = os.path.dirname(os.path.abspath(__file__))  # stays on sys.path: ddp-check's probe is there
    _spec = importlib.machinery.PathFinder.find_spec(  # the sitecustomize we shadow, if any
        "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _here])
    if _spec is not None and _spec.loader is not None:
        _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
"""


def sitecustomize(dumps, more=""):
    """The hook's text: the end watch, Rich's locks renewed in a forked child, the stack dump's
    handler where ``dumps``, then ``more`` (the Flight
    Recorder's thread, flight.RECORDER_HOOK), then whatever sitecustomize it shadows (a rank forked
    warm runs it too, with ``_ddp_up_warm`` set: its interpreter ran that one already)."""
    return HOOK_HEAD + END_WATCH + RICH_AT_FORK + (DUMP_LINE if dumps else "") + more + HOOK_CHAIN


DUMP_HOOK = sitecustomize(True)


def workers_of(match):
    """(pid, rank, local rank) of every worker among the processes that carry ``match``."""
    found = []
    for proc in find_tagged(match):
        if is_launcher(proc):  # a warm rank's stand-in for torchrun (zygote.WARM_STUB) carries its RANK too
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
