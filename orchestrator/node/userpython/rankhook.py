"""Every rank's hook: this file, written as ``sitecustomize.py`` first on the launcher's PYTHONPATH
(attempt/launch.py), runs in every Python process the launcher starts, before the user's code
(a rank forked warm runs it too: launchers/warm.py). Stdlib only, and quiet: nothing here is ever
worth a rank. What it does, in order:

- the end watch: a rank that ended its script cleanly leaves ``ended.RANK`` beside this file as it
  exits (watch_end), which tells a death in the interpreter's teardown from the script's failure;
- Rich's live display (Lightning's bar) keeps each line whole, and a forked child's locks usable;
- where the agent asked for them (a file DUMPS_FILE beside this one, holding the signal), every
  thread's stack on that signal (faulthandler): a job that looks hung, without py-spy;
- where the job records its collectives (DIR_VAR), a thread that keeps torch's Flight Recorder;
- then whatever sitecustomize this one shadows.
"""

import os
import stat  # (os imported it already: no module a cold rank would not have)
import sys

# Its names, which the agent reads from here (watch/stacks.py, watch/flight.py): as a sitecustomize,
# this file stands alone on the rank's path.
DUMPS_FILE = "stack-dumps"  # beside this file: the stack dumps' signal, where the agent wants them
DIR_VAR = "DDP_UP_FLIGHT_DIR"  # where a rank keeps its Flight Recorder's records
EVERY_VAR = "DDP_UP_FLIGHT_EVERY"  # seconds between them
RECORDER_FRAME = "record"  # the recorder thread's function: a stack dump shows it, and the stack reader skips it
RECORDER_THREAD = "ddp-up-flight-recorder"  # its name, which py-spy's dumps show


def _ddp_up_watch_end(where):
    # A rank that ended its script cleanly (no uncaught exception, no exit with a failure) leaves
    # ended.RANK in ``where`` as it exits: a death after that, in the interpreter's teardown (torch's
    # C++ threads at exit), is then not taken for the script's failure (watch/teardown.py). Every
    # exit Python calls is watched: sys.exit, and the builtins exit() and quit() (site's Quitter,
    # which raises SystemExit itself). A bare `raise SystemExit(3)` leaves no code to read here
    # (CPython clears it before the atexit functions run), only a sign that the script did not run
    # to its end (unseen_exit): no marker then. A warm rank's interpreter passes it through
    # sys.exit (warmparent.run), and the launcher's report of each rank's own code is checked as
    # well. Only the rank's own process: DDP_UP_RANK_PID tells its children (a DataLoader's workers) apart.
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
        failed = not (status is None or (type(status) in (int, bool) and status == 0)) or \
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


def _ddp_up_rich_in_child():
    # Rich's live display in a rank (Lightning's bar, drawn live there: attempt/placement.TERMINAL_ENV),
    # and the rank's forked children (a DataLoader's workers) under it: a lock of Rich's that another
    # thread held at the fork (its refresh thread, mid-refresh) is held for good in the child, where
    # that thread is not, and the child's first print (through Rich's redirected stdout) waited for
    # ever. In the child, each such lock is made anew; one this thread holds (a fork from inside a
    # print) stays as it is.
    import threading
    consoles = [getattr(sys.modules.get("rich"), "_console", None)]
    for stream in (sys.stdout, sys.stderr):
        consoles.append(getattr(stream, "_FileProxy__console", None))
    for console in [c for c in consoles if c is not None]:
        lives = list(getattr(console, "_live_stack", None) or []) + [getattr(console, "_live", None)]
        for owner, name in [(console, "_lock"), (console, "_record_buffer_lock")] + [(v, "_lock") for v in lives if v]:
            lock = getattr(owner, name, None)
            if lock is None or not hasattr(lock, "acquire"):
                continue
            if lock.acquire(blocking=False):
                lock.release()
            else:
                setattr(owner, name, threading.RLock())


def _ddp_up_rich_lines(proxy):
    # Rich's redirected streams while its live display runs (a rank's bar, live as on a terminal):
    # a line goes whole, not folded at the console's width (a terminal wraps it where it shows it),
    # and what the rank writes to stderr stays on stderr, as by hand.
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
        import importlib.machinery
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


def _ddp_up_after_fork():
    try:
        "rich" in sys.modules and _ddp_up_rich_in_child()
    except Exception:
        pass  # Rich's insides changed: the child goes on as it would have


def _ddp_up_watch_rich():
    if "RANK" in os.environ:
        if "rich.file_proxy" in sys.modules:  # a rank forked warm from an interpreter that imported Rich
            _ddp_up_rich_lines(sys.modules["rich.file_proxy"].FileProxy)
        else:
            sys.meta_path.insert(0, _DdpUpRichWatch())
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_ddp_up_after_fork)


def _ddp_up_stack_dumps(where):
    # Every thread's stack on the signal the agent named (SIGUSR1 is often the application's own,
    # e.g. for requeueing: a real-time one), where it asked for them.
    try:  # the agent's file, in its private folder: read as a regular file all the same, no link, no blocking
        fd = os.open(os.path.join(where, DUMPS_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            signum = int(os.read(fd, 16)) if stat.S_ISREG(os.fstat(fd).st_mode) else None
        finally:
            os.close(fd)
    except (OSError, ValueError):
        return
    if signum is None:
        return
    import faulthandler
    faulthandler.register(signum, all_threads=True, chain=False)  # ddp-up: stack dump when a job looks hung


def _ddp_up_flight_recorder(out, every):
    # Works only in a worker (RANK set) whose torch.distributed is initialized. Its thread never
    # raises into the job, and a record is replaced whole (a reader never sees half of one).
    import threading
    import time

    def record():
        up = False  # until the rank's process group is up, looked for twice a second (up.RANK)
        while True:
            time.sleep(every - time.time() % every if up else 0.5)
            try:
                dist = sys.modules.get("torch.distributed")
                if dist is None or not dist.is_available() or not dist.is_initialized():
                    continue
                rank, c10d = dist.get_rank(), sys.modules["torch._C._distributed_c10d"]
                if not up:
                    up = True
                    os.close(os.open(os.path.join(out, "up.%d" % rank), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
                    continue
                for kind, dump in (("fr", "_dump_fr_trace_json"), ("nccl", "_dump_nccl_trace_json")):
                    if hasattr(c10d, dump):
                        data = getattr(c10d, dump)(True, False)
                        path = os.path.join(out, "%s.%d.json" % (kind, rank))
                        fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
                        with os.fdopen(fd, "wb") as f:
                            f.write(data if isinstance(data, bytes) else data.encode())
                        os.replace(path + ".tmp", path)
            except Exception:
                pass  # a record is never worth a job's failure
    threading.Thread(target=record, name=RECORDER_THREAD, daemon=True).start()


def _ddp_up_chain(here):
    # The sitecustomize this one shadows, if any (a rank forked warm does not: its interpreter ran it).
    import importlib.machinery
    import importlib.util
    spec = importlib.machinery.PathFinder.find_spec(
        "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != here])
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


def _ddp_up_hook(here, warm):
    import faulthandler, importlib.machinery, importlib.util  # noqa: F401,E401 (as every rank had them: one set)
    _ddp_up_watch_end(here)
    _ddp_up_watch_rich()
    _ddp_up_stack_dumps(here)
    if os.environ.get(DIR_VAR) and os.environ.get("RANK") is not None:
        _ddp_up_flight_recorder(os.environ[DIR_VAR], float(os.environ.get(EVERY_VAR) or 5))
    if not warm:
        _ddp_up_chain(here)


if __name__ in ("sitecustomize", "ddp_up_hook"):  # Python's site, or a rank forked warm (inchild.become)
    _ddp_up_hook(os.path.dirname(os.path.abspath(__file__)), globals().get("_ddp_up_warm", False))
