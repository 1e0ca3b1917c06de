"""Warm start, in the parent: the warm interpreter itself (see launchers/warm.py for what it is and
how the agent talks to it). It imports torch and the cluster file's `preload:` (prepare, watched
by beforefork), then forks a rank on each request (serve: the agent's, or torchrun's stand-ins'),
and each child becomes its rank (inchild). Run from its files in the job's own Python (LOADER),
stdlib only; nothing of ddp-up's but this room is importable there.
"""

import array
import gc
import json
import os
import signal
import socket
import struct
import sys
import time

from .beforefork import Seen, process_state
from .inchild import await_store, become, from_script, run_script, uncaught, without_teardown
from .names import PACKAGE, TORCHRUN, WARM_MARK
from .proctitle import rename

# Its command line: this room's directory, then main's arguments. The path is ours only to import from.
LOADER = (WARM_MARK + "import sys;sys.path.insert(0,sys.argv.pop(1));from %s.warmparent import main;"
          "del sys.path[0];main(sys.argv[1:])" % PACKAGE)
HELLO, SEEN, STALE = {}, None, False  # its answer to a hello; what the imports did; whether its code is old


def say(conn, obj):
    try:
        conn and conn.sendall(json.dumps(obj).encode() + b"\n")
    except OSError:
        pass  # a stand-in gone (torchrun killed it): its rank is reaped all the same


def prepare(ctl, names, keep):
    # Its one answer to the agent (and, kept, to every launch's hello): ready, or cold and why. Each
    # import is watched for what would make a forked rank differ from a cold one (SEEN): what it did
    # to the process, the threads it left, the rank's variables it read.
    global HELLO
    started, notices = time.monotonic(), []
    for name in names:
        quiet, name = name.startswith("?"), name.lstrip("?")  # ?: the default's (torch), not the user's
        before = process_state()
        say(ctl, {"importing": name})  # the agent names it, if this import never ends or ends the process
        try:
            with SEEN.reading(name):
                __import__(name)
        except BaseException as e:  # an ImportError, or whatever the module raised
            if not quiet:  # a job without torch (`launcher: none`) is no news: it runs warm all the same
                said = (str(e).strip().splitlines() or [""])[0]
                said = said if len(said) <= 300 else said[:300] + "..."
                notices.append("preload %s failed (%s: %s): the ranks import it themselves" % (name, type(e).__name__, said))
            continue
        why = ("importing %s initialized CUDA, and a process forked after that cannot use it" % name
               if cuda_touched() else SEEN.after_import(name, before, process_state()))
        if why:
            HELLO = {"cold": why}
            say(ctl, HELLO)
            if not keep:
                os._exit(0)
            return  # kept: it answers the launches' hellos with why, and forks nothing
    SEEN.ready()
    # Every object made so far (torch's, the preloaded modules') out of the collector's reach, as
    # CPython advises before forking: a forked rank's collections, and the last one at its exit,
    # then skip them. With torch imported, a rank's exit took 0.8 s, and wrote to every page it
    # shared with this interpreter; 0.3 s with them frozen. They are modules: they live as long.
    gc.freeze()
    HELLO = {"ready": os.getpid(), "seconds": round(time.monotonic() - started, 3), "notices": notices}
    say(ctl, HELLO)




def cuda_touched():
    # Whether a child forked now could not use CUDA. Three signs, each seen on an H200: torch made
    # its context (is_initialized); the CUDA driver mapped its device files here (a context made
    # by any library: CuPy, JAX); torch asked the driver for the device count, as
    # torch.cuda.is_available() does at import in some libraries, after which torch refuses CUDA
    # in every forked child (its "bad fork"): a child forked to ask tells.
    cuda = getattr(sys.modules.get("torch"), "cuda", None)
    if cuda is not None and cuda.is_initialized():
        return True
    try:
        with open("/proc/self/maps") as maps:
            if any("/dev/nvidia" in line for line in maps):
                return True
    except OSError:
        pass
    in_bad_fork = getattr(cuda, "_is_in_bad_fork", None)
    if in_bad_fork is None:
        return False
    pid = os.fork()
    if pid == 0:
        os._exit(1 if in_bad_fork() else 0)
    return os.waitpid(pid, 0)[1] != 0


def listen(path):
    # The socket torchrun's stand-ins ask on (standin.py), in the job's private directory; bound by
    # its name from there, as a full path may be longer than a socket's. None: the agent's alone.
    if not path:
        return None
    here, listener = os.getcwd(), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        os.chdir(os.path.dirname(path))
        listener.bind(os.path.basename(path))
        listener.listen(64)
        return listener
    except OSError:
        listener.close()
        return None
    finally:
        os.chdir(here)


REQUEST_BOUND = 5.0  # seconds an asker (a stand-in, a launch's hello) has to send its whole request
REQUEST_MOST = 4 << 20  # bytes of one request


def let_in(listener, pending):
    # A new asker: one of this user's processes only (asked of the kernel before anything is read),
    # read as its bytes come, never waited on (serve goes on forking and reaping meanwhile).
    conn, _ = listener.accept()
    try:
        uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
        if uid != os.getuid():
            raise OSError("not this user's")
        conn.setblocking(False)
    except OSError:
        conn.close()
        return
    pending[conn] = [time.monotonic() + REQUEST_BOUND, b"", array.array("i")]


def drop(conn, pending):
    for fd in pending.pop(conn)[2]:
        os.close(fd)
    conn.close()


def asked(conn, pending):
    # (the asker's connection, its request with its stdin, stdout and stderr) once the request is
    # whole, or None. Framing: one byte carrying the descriptors (SCM_RIGHTS), then a JSON line. A
    # kept interpreter's launches ask first whether it is ready ({"hello": 1}, without
    # descriptors): its HELLO answers. Too slow, too long or not a request: dropped.
    bound, data, fds = pending[conn]
    try:
        chunk, extra, _, _ = conn.recvmsg(1 << 16, socket.CMSG_SPACE(3 * fds.itemsize))
    except BlockingIOError:
        return None
    except OSError:
        chunk, extra = b"", []
    for level, kind, given in extra:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(given[:len(given) - len(given) % fds.itemsize])
    data = pending[conn][1] = data + chunk
    if not chunk or len(data) > REQUEST_MOST or len(fds) > 3:
        drop(conn, pending)
        return None
    if data.count(b"\n") < 2:
        return None
    fds = pending[conn][2]
    try:
        request = json.loads(data[1:].split(b"\n", 1)[0])
        if not isinstance(request, dict):
            raise ValueError("not a request")
    except ValueError:
        drop(conn, pending)
        return None
    if request.get("hello") and not len(fds):
        stale = "ready" in HELLO and SEEN.refusal({})
        if stale and stale[0] == "STALE":
            went_stale(stale[1])
        conn.setblocking(True)
        conn.settimeout(1.0)
        say(conn, HELLO)
        drop(conn, pending)
        return None
    if len(fds) != 3 or "cold" in HELLO:  # not a stand-in's request, or nothing to fork from
        drop(conn, pending)
        return None
    request["fds"] = list(pending.pop(conn)[2])
    conn.setblocking(True)
    conn.settimeout(None)
    return conn, request


def overdue(pending):
    # The askers that did not send their request within REQUEST_BOUND: dropped (their stand-ins
    # start their ranks cold).
    now = time.monotonic()
    for conn in [c for c, (bound, _, _) in pending.items() if bound < now]:
        drop(conn, pending)


def went_stale(why):
    # A module it imported changed on disk: it forks nothing more, and ends once its ranks have
    # (a restart, or a session's next launch, then makes a fresh one; meanwhile ranks start cold).
    global HELLO, STALE
    HELLO, STALE = {"cold": why}, True


def refuse(ctl, owner, request, why):
    # A request it will not fork: the asker starts that rank cold, and is told why.
    for fd in request.get("fds", ()):
        os.close(fd)
    if owner is ctl:
        say(ctl, {"refused": request.get("start"), "why": why})
    else:
        say(owner, {"cold": why})
        owner.close()


class Server:
    """The interpreter's loop once its imports are done: it forks on request (the agent's, or a
    stand-in's) and tells each asker its rank's end. ``serve`` returns in a child only, with its
    request; the interpreter itself ends there once nothing is left to serve."""

    def __init__(self, ctl, listener):
        self.ctl, self.listener = ctl, listener
        self.owners = {}  # child pid -> the connection that asked for it (None: that stand-in is gone)
        self.pending = {}  # an asker's connection -> [its bound, what it sent so far, its descriptors]
        self.buffered, self.given, self.open = b"", array.array("i"), True  # the agent's requests, and its descriptors
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)

    def serve(self):
        import select
        while (self.open and not STALE) or self.owners:
            if self.listener is not None and STALE:
                self.listener.close()  # a stand-in that asks now is refused at once, and starts cold
                self.listener = None
            askers = [c for c in self.owners.values() if c is not None and c is not self.ctl]
            watch = [self.wake_r] + askers + list(self.pending)
            if self.open:
                watch += [self.ctl] + ([self.listener] if self.listener else [])
            ready, _, _ = select.select(watch, [], [], 1.0 if not self.pending else 0.25)
            overdue(self.pending)
            self.lost(ready, askers)
            if self.wake_r in ready:
                os.read(self.wake_r, 4096)
            self.reap()
            for owner, request in self.requests(ready):
                if self.fork(owner, request):
                    return request
        os._exit(0)

    def lost(self, ready, askers):
        # A stand-in gone: torchrun killed it (SIGKILL, past its grace); its rank goes with it, as cold.
        for pid, owner in list(self.owners.items()):
            if owner in ready and owner in askers and not owner.recv(1):
                self.owners[pid] = None
                owner.close()
                os.kill(pid, signal.SIGKILL)

    def reap(self):
        while self.owners:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                return
            owner = self.owners.pop(pid, self.ctl)
            say(owner, {"ended": pid, "code": -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)})
            if owner is not self.ctl and owner is not None:
                owner.close()

    def requests(self, ready):
        # (asker, request) of every request made whole by what is ready: the stand-ins', then the agent's.
        found = []
        if self.listener is not None and self.listener in ready:
            let_in(self.listener, self.pending)
        for conn in [c for c in ready if c in self.pending]:
            found += [r for r in [asked(conn, self.pending)] if r]
        if self.ctl in ready:
            data, extra, _, _ = self.ctl.recvmsg(1 << 16, socket.CMSG_SPACE(3 * 4))
            for level, kind, fds in extra:  # a launcher's stdio, sent with its request (Warm.fork)
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    self.given.frombytes(fds[:len(fds) - len(fds) % self.given.itemsize])
            self.open = bool(data)
            self.buffered += data
            while b"\n" in self.buffered:
                line, self.buffered = self.buffered.split(b"\n", 1)
                request = json.loads(line)
                if request.get("fds"):
                    request["fds"], self.given = list(self.given[:3]), self.given[3:]
                found.append((self.ctl, request))
        return found

    def fork(self, owner, request):
        # Whether this is the child forked for ``request`` (the parent refuses it, or forks it and goes on).
        refused = ("STALE", HELLO["cold"]) if STALE else SEEN.refusal(request.get("env") or {})
        if refused:
            if refused[0] == "STALE":
                went_stale(refused[1])
            refuse(self.ctl, owner, request, refused[1])
            return False
        pid = os.fork()
        if pid == 0:
            self.in_child(owner)
            return True
        for fd in request.get("fds", ()):
            os.close(fd)
        self.owners[pid] = owner
        say(owner, {"started": request.get("start"), "pid": pid})
        return False

    def in_child(self, owner):
        # The child keeps nothing of the parent's: its signal wake-up, its sockets, others' descriptors.
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in (self.wake_r, self.wake_w):
            os.close(fd)
        for conn in [self.ctl, self.listener, owner] + [c for c in self.owners.values() if c is not None] + list(self.pending):
            if conn is not None:
                conn.close()
        for _, _, given in self.pending.values():
            for fd in given:
                os.close(fd)


def bound_to_agent(agent):
    # Ends with the agent that started it (a SIGKILL from the kernel), however the agent ends.
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG; a fork's child does not inherit it
    except Exception:
        pass
    if os.getppid() != agent:  # gone already
        os._exit(0)


def main(argv):
    """``argv``: its socket to the agent (a descriptor), the modules to import (comma-separated),
    the agent's pid, the path to listen on for stand-ins (or ""), and "keep" for a kept one."""
    global SEEN
    bound_to_agent(int(argv[2]))
    rename([sys.executable, "-u", "-c", WARM_MARK + " # ddp-up's warm interpreter: torch imported, the ranks forked from it"],
           "ddp-up-warm")  # in ps and top, a line and a name, not its loader
    ctl = socket.socket(fileno=int(argv[0]))
    listener = listen(argv[3])  # before the imports: a stand-in that asks early waits in its queue
    SEEN, home = Seen(), os.getcwd()  # home: where it started, which its own PYTHONPATH's relative entries are from
    prepare(ctl, [n for n in argv[1].split(",") if n], argv[4] == "keep")
    request = Server(ctl, listener).serve()
    run(request, *become(request, SEEN, home))


def run(request, module, target):
    """In the child, now its rank: the script (or module) run as ``python -u`` would, without this
    room's modules in sys.modules (the rank's own code never sees them)."""
    after = request.get("after")  # torchrun's, on a node other than the master's: the master's store
    for name in [n for n in sys.modules if n == PACKAGE or n.startswith(PACKAGE + ".")]:
        del sys.modules[name]
    import runpy
    if module and target == TORCHRUN:  # torchrun: ddp-up's launcher, never the user's program
        sys.excepthook = from_script
        if after:
            await_store(after)
        without_teardown(lambda: runpy.run_module(target, run_name="__main__", alter_sys=True))
        return
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            run_script(request["argv"][0], target)
    except SystemExit as e:  # raised however (raise SystemExit(3) too): through sys.exit, which
        sys.exit(e.code)  # ddp-up's end watch hears (rankhook), as the script's own end
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - the interpreter's own end of an uncaught exception
        uncaught(e)
