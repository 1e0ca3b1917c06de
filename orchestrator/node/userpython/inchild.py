"""Warm start, in the child: the rank made what ``python -u SCRIPT ARGS`` (or ``-m MODULE``) would
be, after the fork (see launchers/warm.py). Run in the warm interpreter's child alone, stdlib only.

``become`` turns the child into it: its stdio, working directory, environment (with what the
imports gave a cold rank: beforefork.Seen), sys.path (repath), name in ps and /proc
(proctitle.rename), and ddp-up's hook of the attempt. torchrun forked so waits for the master's
store on a node other than the master's (await_store), and ends without the interpreter's
teardown (without_teardown); a script is run as a cold start runs it (run_script), and its
traceback starts at its first frame (uncaught; torchrun's: from_script).
"""

import os
import socket
import sys
import time

from .proctitle import rename

# this room's files, where the warm interpreter imported it: no frame of theirs is the rank's (in the agent: none)
HERE = os.path.dirname(os.path.abspath(globals()["__file__"])) if "__file__" in globals() else None


def repath(mine, theirs, home):
    # sys.path as the rank's own PYTHONPATH makes it in a cold start (ddp-up's hooks, the Python
    # API's function runner, the user's own): right after the script's folder, in place of the
    # interpreter's, each entry made absolute from the rank's working directory (an empty one is
    # that directory) and each path kept once, as Python's site does (3.8 to 3.13 alike).
    # Returns the sitecustomize a cold start would have run that this interpreter did not: the
    # first on the rank's own part of the path (ddp-up's hook of the attempt), or None.
    gone = {os.path.normpath(os.path.join(home, p)) for p in mine.split(os.pathsep)} if mine else set()
    theirs_list = [os.path.abspath(p) for p in theirs.split(os.pathsep)] if theirs else []
    kept, seen = [], set()
    for entry in theirs_list + [p for p in sys.path[1:] if p not in gone]:
        if entry not in seen:
            seen.add(entry)
            kept.append(entry)
    sys.path[1:] = kept
    if mine == theirs:
        return None
    for entry in theirs_list:
        hook = os.path.join(entry, "sitecustomize.py")
        if entry not in gone and os.path.isfile(hook):
            return hook
    return None


def become(request, seen, home):
    os.setsid()
    if "fds" in request:  # a stand-in's: the stdio torchrun gave it
        for fd, given in enumerate(request["fds"]):
            os.dup2(given, fd)
        for given in set(request["fds"]) - {0, 1, 2}:
            os.close(given)
    else:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            opened = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            os.dup2(opened, fd)
            os.close(opened)
    os.chdir(request["cwd"])
    before = dict(os.environ)
    os.environ.clear()
    os.environ.update(request["env"])
    seen.in_rank()  # the imports' variables, fresh randomness, what Lightning read of the rank
    first = ("RANK", "LOCAL_RANK")
    added = sorted(((k, v) for k, v in request["env"].items() if before.get(k) != v), key=lambda kv: kv[0] not in first)
    hook = repath(before.get("PYTHONPATH", ""), request["env"].get("PYTHONPATH", ""), home)
    argv = list(request["argv"])
    if argv[0] == "-m":  # python -m MODULE ARGS: the working directory first on the path
        sys.argv, sys.path[0], target = argv[1:], os.getcwd(), argv[1]
    else:
        sys.argv, sys.path[0], target = argv, os.path.dirname(os.path.abspath(argv[0])), os.path.abspath(argv[0])
    rename([sys.executable, "-u"] + argv, os.path.basename(target), added)
    if hook:  # ddp-up's sitecustomize of this attempt, on the rank's path only: its interpreter ran the user's
        with open(hook) as f:
            exec(compile(f.read(), hook, "exec"), {"__name__": "ddp_up_hook", "__file__": hook, "_ddp_up_warm": True})
    return argv[0] == "-m", target


def await_store(after, every=0.02, most=0.25, bound=60.0):
    # torchrun on a node other than the master connects to the master's store first thing and,
    # refused, tries again after a backoff that grows (0.25 s, then about 1 s, measured here).
    # Forked the moment this node's imports end, it mostly found the master's torchrun not
    # listening yet, and slept on after it was (0.9 s of a 4-node launch). So it starts once the
    # store answers, polled every ``every`` seconds at first, then less often up to every ``most``
    # (a thousand nodes waiting on a master still importing then knock at most 4,000 times a
    # second in all), for ``bound`` seconds at most: then torchrun's own retries and timeout take
    # over, as cold. An answer from the master's agent (its hold of the port, until its own Go)
    # ends the wait too: torchrun then retries as it would have.
    try:  # resolved once; each of its addresses tried, as torchrun tries them
        addresses = [(a[0], a[1], a[2], a[4]) for a in socket.getaddrinfo(after[0], after[1], type=socket.SOCK_STREAM)]
    except (OSError, TypeError, ValueError):
        return
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        for family, kind, proto, address in addresses:
            probe = socket.socket(family, kind, proto)
            try:
                probe.settimeout(1.0)
                probe.connect(address)
                return
            except OSError:
                pass
            finally:
                probe.close()
        time.sleep(every)
        every = min(most, every * 1.2)


def script_frames(tb):
    # A traceback from the script's first frame, as a cold start has it: without this
    # interpreter's own frames and runpy's (the whole of it, where none is the script's).
    first = tb
    while first is not None and (first.tb_frame.f_code.co_filename == "<string>" or
                                 os.path.dirname(first.tb_frame.f_code.co_filename) == HERE or
                                 "runpy" in first.tb_frame.f_code.co_filename):
        first = first.tb_next
    return first if first is not None else tb


def from_script(kind, value, tb):
    # torchrun's uncaught exception, printed from its first frame (ddp-up's launcher: its hook is ours)
    tb = script_frames(tb)
    if isinstance(value, BaseException):
        value = value.with_traceback(tb)  # what newer Pythons print from
    sys.__excepthook__(kind, value, tb)


def run_script(given, path):
    # The script run as `python -u SCRIPT` runs it, in a __main__ of its own with what a cold start
    # gives it: sys.argv[0] as the command line names it, __file__ absolute (Python 3.9 on), a
    # SourceFileLoader, __package__ None. (runpy.run_path gave sys.argv[0] and __file__ as the path
    # it was handed, no loader, and __package__ "".) The interpreter deletes __file__ once the
    # script ran to its end (rankhook.unseen_exit reads that); an exception keeps it.
    import builtins
    import importlib.machinery
    import types
    shown = path if sys.version_info >= (3, 9) else given
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=shown, __cached__=None, __builtins__=builtins, __spec__=None, __package__=None,
                         __loader__=importlib.machinery.SourceFileLoader("__main__", shown))
    if "__annotations__" in vars(sys.modules["__main__"]):
        main.__annotations__ = {}
    sys.modules["__main__"] = main
    with open(path, "rb") as f:
        code = compile(f.read(), shown, "exec", dont_inherit=True)
    exec(code, main.__dict__)
    main.__dict__.pop("__file__", None)


def uncaught(error):
    # An exception the script let go, as the interpreter takes one: kept as sys.last_*, given to
    # sys.excepthook (the rank's own, as a cold rank's: Python's, or one the script installed)
    # from the script's first frame, then exit status 1, the atexit functions run.
    tb = script_frames(error.__traceback__)
    error = error.with_traceback(tb)
    sys.last_type, sys.last_value, sys.last_traceback = type(error), error, tb
    if sys.version_info >= (3, 12):
        sys.last_exc = error
    sys.excepthook(type(error), error, tb)
    raise SystemExit(1)


def without_teardown(run):
    # torchrun's end without the interpreter's teardown, which frees every module's objects and so
    # writes to each page this process still shares with the interpreter it was forked from: 0.3 s
    # of CPU per node, paid as the job ends (measured with process accounting). What the teardown
    # does that torchrun needs is done first, in its order: its threads joined (threading._shutdown,
    # as Py_FinalizeEx calls it), its atexit functions, its streams flushed; then its exit status,
    # as Python gives it: SystemExit's, or 1 after an uncaught exception's traceback (a rank's
    # failure: this end is on the way to the restart). KeyboardInterrupt takes the usual way.
    try:
        run()
        code = 0
    except SystemExit as e:
        code = e.code
    except KeyboardInterrupt:
        raise
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    threading = sys.modules.get("threading")
    if threading is not None and hasattr(threading, "_shutdown"):
        threading._shutdown()
    import atexit
    atexit._run_exitfuncs()
    if code is None:
        code = 0
    elif not isinstance(code, int):
        sys.stderr.write("%s\n" % (code,))
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)
