"""Warm start: an interpreter on the node that imported torch (and the cluster file's `preload:`)
before it was asked, and forks each rank from it, so a rank begins without importing them again.

The warm interpreter is the job's own Python, started by the agent with the job's environment
while the preflight runs. It runs ZYGOTE (below, stdlib only): the imports, then one check that
nothing initialized CUDA (a forked child cannot use a CUDA context its parent made), then it
answers the agent on a socket, one JSON object a line:

  interpreter -> agent   {"ready": PID, "seconds": S, "notices": [...]}  or  {"cold": REASON}
  agent -> interpreter   {"start": LOCAL_RANK, "argv": [SCRIPT, ARGS...], "env": {...}, "cwd": DIR,
                          "stdout": PATH, "stderr": PATH, "hook": CODE or null}
  interpreter -> agent   {"started": LOCAL_RANK, "pid": PID}, later {"ended": PID, "code": CODE}

Each child becomes what ``python -u SCRIPT ARGS`` would be: its own session, stdin from
/dev/null, stdout and stderr to the rank's log files, the rank's working directory, environment
(os.environ and the C library's, which NCCL reads), ``sys.argv``, ``sys.path[0]``, the script run
as ``__main__`` by runpy, and Python's own exit (threads joined, atexit, an uncaught exception's
traceback and code 1, KeyboardInterrupt's SIGINT). Its name in ps and top is the rank's.
When the agent closes the socket, the interpreter forks nothing more and exits once its
children have. The agent's side is ``Warm``: a child is a ``WarmChild``, which Workers waits on
and signals like a Popen (by pid, pinned and re-checked against the job's tags, which the
interpreter's environment carries).
"""

import json
import os
import socket
import subprocess
import threading
import time

from .procs import WARM_MARK

PRELOAD = ("torch", "torch.distributed")  # what every warm interpreter imports, before the cluster file's
READY_TIMEOUT = 120.0  # seconds for the imports; past it the ranks start cold
LINE_MAX = 1 << 20  # bytes of one line from the interpreter (it is the job's Python: bounded)

ROOM_VAR = "DDP_UP_WARM_ROOM"  # the interpreter's last variable: room for its ranks' own in /proc/PID/environ
ROOM = 8192

ZYGOTE = WARM_MARK + r'''
import json, os, signal, socket, sys, time


def say(ctl, obj):
    ctl.sendall(json.dumps(obj).encode() + b"\n")


def prepare(ctl, names):
    started, notices = time.monotonic(), []
    for name in names:
        try:
            __import__(name)
        except BaseException as e:  # an ImportError, or whatever the module raised
            notices.append("preload %s failed (%s: %s): the ranks import it themselves" % (name, type(e).__name__, e))
            continue
        torch = sys.modules.get("torch")
        cuda = getattr(torch, "cuda", None)
        if cuda is not None and cuda.is_initialized():
            say(ctl, {"cold": "importing %s initialized CUDA, and a process forked after that cannot use it" % name})
            os._exit(0)
    say(ctl, {"ready": os.getpid(), "seconds": round(time.monotonic() - started, 3), "notices": notices})


def serve(ctl):
    """Fork on request; report ends. Returns in a child only, with its request."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    import select
    children, buffered, open_ = set(), b"", True
    while open_ or children:
        ready, _, _ = select.select([ctl, wake_r] if open_ else [wake_r], [], [], 1.0)
        if wake_r in ready:
            os.read(wake_r, 4096)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            say(ctl, {"ended": pid, "code": code})
        if ctl in ready:
            data = ctl.recv(1 << 16)
            if not data:
                open_ = False
                continue
            buffered += data
            while b"\n" in buffered:
                line, buffered = buffered.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    for fd in (wake_r, wake_w):
                        os.close(fd)
                    ctl.close()
                    return request
                children.add(pid)
                say(ctl, {"started": request["start"], "pid": pid})
    os._exit(0)


def rename(words, added):
    """This process as ps, top and /proc show it: the rank's command line and name, and in its
    /proc/PID/environ, the variables its rank added (RANK first: ddp-kill, the stack dumps and ps
    -e read them there), written over ROOM_VAR's value, the interpreter's last variable. The
    interpreter's own variables stay where they are: C code may hold pointers into them."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, ctypes.c_char_p(os.path.basename(words[2]).encode()[:15]), 0, 0, 0)  # PR_SET_NAME
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end
        text = "\0".join(words).encode()[:end - start - 1]
        ctypes.memmove(start, text + b"\0" * (end - start - len(text)), end - start)
        start, end = int(fields[47]), int(fields[48])  # env_start, env_end
        at = ctypes.string_at(start, end - start).rfind(b"\0ROOM_VAR=") + 1
        if at > 0:
            text = b"".join(b"%s=%s\0" % (k.encode(), v.encode()) for k, v in added
                            if len(k) + len(v) + 2 < end - start - at)
            ctypes.memmove(start + at, (text + b"\0" * (end - start - at))[:end - start - at], end - start - at)
    except Exception:
        pass  # a name is never worth a rank


def become(request):
    os.setsid()
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
    first = ("RANK", "LOCAL_RANK")
    added = sorted(((k, v) for k, v in request["env"].items() if before.get(k) != v), key=lambda kv: kv[0] not in first)
    script = request["argv"][0]
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    rename([sys.executable, "-u"] + sys.argv, added)
    if request.get("hook"):
        exec(compile(request["hook"], "ddp-up-hook", "exec"), {"__name__": "ddp_up_hook"})
    return os.path.abspath(script)


def from_script(kind, value, tb):
    """An uncaught exception's traceback from the script's first frame, as a cold start prints it."""
    first = tb
    while first is not None and os.path.abspath(first.tb_frame.f_code.co_filename) != SCRIPT:
        first = first.tb_next
    if first is not None and isinstance(value, BaseException):
        tb = first
        value = value.with_traceback(tb)  # what newer Pythons print from
    sys.__excepthook__(kind, value, tb)


def bound_to_agent(agent):
    """Ends with the agent that started it (a SIGKILL from the kernel), however the agent ends."""
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG; a fork's child does not inherit it
    except Exception:
        pass
    if os.getppid() != agent:  # gone already
        os._exit(0)


bound_to_agent(int(sys.argv[3]))
ctl = socket.socket(fileno=int(sys.argv[1]))
prepare(ctl, [n for n in sys.argv[2].split(",") if n])
SCRIPT = become(serve(ctl))
sys.excepthook = from_script
del ctl, prepare, serve, become, rename, bound_to_agent
import runpy
runpy.run_path(SCRIPT, run_name="__main__")
'''.replace("ROOM_VAR", ROOM_VAR)


class WarmChild:
    """A rank forked by the warm interpreter, as Workers waits on it and signals it: like a Popen."""

    def __init__(self, pid):
        self.pid = pid
        self.returncode = None
        self.ended = threading.Event()

    def end(self, code):
        self.returncode = code
        self.ended.set()

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        if not self.ended.wait(timeout):
            raise subprocess.TimeoutExpired("rank %d" % self.pid, timeout)
        return self.returncode


class Warm:
    """The agent's side of one warm interpreter: started at once, ready (or not) later. ``fork``
    gives a WarmChild, or None where the ranks start cold (not ready, gone, or it said why)."""

    def __init__(self, python, env, cwd, log, preload=(), base=PRELOAD):
        names = list(base) + [n for n in preload if n not in base]
        env = dict(env)
        env.pop(ROOM_VAR, None)
        env[ROOM_VAR] = "." * ROOM  # last: see rename in ZYGOTE
        self.sock, theirs = socket.socketpair()
        with open(log, "ab") as err:  # its own errors (a crash while importing): the ranks' go to their logs
            self.proc = subprocess.Popen([python, "-u", "-c", ZYGOTE, str(theirs.fileno()), ",".join(names), str(os.getpid())],
                                         env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=err, stderr=err,
                                         pass_fds=(theirs.fileno(),), start_new_session=True)
        theirs.close()
        self.lock = threading.Lock()
        self.hello = None  # the interpreter's first answer: {"ready": ...} or {"cold": ...}
        self.said = threading.Event()
        self.children = {}  # pid -> WarmChild
        self.started = {}  # local rank -> pid, as the interpreter reports them
        self.forked = threading.Condition(self.lock)
        self.buffer = b""
        self.closed = False  # its attempt's ranks were all asked for: a later attempt's start cold
        threading.Thread(target=self.read, name="warm", daemon=True).start()

    def read(self):
        try:
            while True:
                line = self.line()
                if line is None:
                    break
                self.take(json.loads(line))
        except (OSError, ValueError):
            pass
        self.said.set()
        with self.lock:  # the interpreter is gone: a child it never reported ends unknown
            for child in self.children.values():
                if child.returncode is None:
                    threading.Thread(target=watch_orphan, args=(child,), daemon=True).start()
            self.forked.notify_all()

    def line(self):
        while b"\n" not in self.buffer:
            data = self.sock.recv(1 << 16)
            if not data or len(self.buffer) > LINE_MAX:
                return None
            self.buffer += data
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line

    def take(self, message):
        if "ready" in message or "cold" in message:
            self.hello = message
            self.said.set()
        elif "started" in message:
            with self.lock:
                child = self.children[message["pid"]] = WarmChild(int(message["pid"]))
                self.started[int(message["started"])] = child
                self.forked.notify_all()
        elif "ended" in message:
            with self.lock:
                child = self.children.get(message["ended"])
            if child is not None:
                child.end(int(message["code"]))

    def ready(self, timeout=READY_TIMEOUT):
        """Whether ranks can be forked: the imports done, CUDA untouched."""
        self.said.wait(timeout)
        return bool(self.hello and "ready" in self.hello)

    def why_cold(self):
        """The one notice for a user whose ranks start cold, or None."""
        if self.hello is None:
            return "warm start: the warm interpreter did not get ready; the ranks start cold"
        return "warm start: %s; the ranks start cold" % self.hello["cold"] if "cold" in self.hello else None

    def notices(self):
        return list((self.hello or {}).get("notices") or ())

    def fork(self, local_rank, argv, env, cwd, stdout, stderr, hook=None, timeout=30.0):
        """A WarmChild running ``argv`` (SCRIPT ARGS) as local rank ``local_rank``; None if the
        interpreter cannot fork it (the caller starts that rank cold)."""
        if not self.ready(0):
            return None
        request = {"start": local_rank, "argv": list(argv), "env": dict(env), "cwd": cwd, "stdout": stdout,
                   "stderr": stderr, "hook": hook}
        deadline = time.monotonic() + timeout
        with self.lock:
            try:
                self.sock.sendall(json.dumps(request).encode() + b"\n")
            except OSError:
                return None
            while local_rank not in self.started and self.proc.poll() is None and time.monotonic() < deadline:
                self.forked.wait(0.5)
            return self.started.pop(local_rank, None)

    def close(self):
        """No more forks: the interpreter exits once its children have (at once without any)."""
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def abandon(self):
        """Never used (no Go): the interpreter ends now, whatever it was importing."""
        self.close()
        if not self.children:
            self.proc.kill()
        self.proc.wait()


def watch_orphan(child, every=0.5):
    """A child whose interpreter died: it ends when its pid is gone (its code unknown: 1)."""
    while True:
        try:
            os.kill(child.pid, 0)
        except ProcessLookupError:
            child.end(1)
            return
        except OSError:
            pass
        time.sleep(every)
