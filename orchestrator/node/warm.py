"""Warm start: an interpreter on the node that imported torch (and the cluster file's `preload:`)
before it was asked, and forks each rank from it, so a rank begins without importing them again.

The warm interpreter is the job's own Python, started by the agent with the job's environment
once the node's preflight passed. It runs ZYGOTE (below, stdlib only): the imports, then one check
that nothing initialized CUDA (a forked child cannot use a CUDA context its parent made), then it
answers, one JSON object a line, on two sockets:

  the agent's (a socketpair)                     `launcher: none`: Workers asks for each rank
    interpreter -> agent   {"ready": PID, "seconds": S, "notices": [...]}  or  {"cold": REASON}
    agent -> interpreter   {"start": LOCAL_RANK, "argv": [SCRIPT, ARGS...], "env": {...}, "cwd": DIR,
                            "stdout": PATH, "stderr": PATH}
    interpreter -> agent   {"started": LOCAL_RANK, "pid": PID}, later {"ended": PID, "code": CODE}
  a listening one, in the job's private directory   torchrun: each worker is a stand-in (WARM_STUB)
    stand-in -> interpreter   its stdin, stdout and stderr (SCM_RIGHTS), then {"argv", "env", "cwd"}
    interpreter -> stand-in   {"started": null, "pid": PID}, later {"ended": PID, "code": CODE}

The agent also asks it for torchrun itself ("start": null, with its stdio sent along): torchrun
then starts without importing torch. Each child becomes what ``python -u SCRIPT ARGS`` (or ``-m
MODULE``) would be (see docs/guides/warm-start.md), with ddp-up's hook of the attempt (stack dumps,
the Flight Recorder) and the rank's name in ps, top and /proc/PID/environ. The interpreter dies
with the agent (PR_SET_PDEATHSIG); a stand-in killed by torchrun takes its rank with it. The
agent's side is ``Warm``: a child it asked for is a ``WarmChild``, waited on like a Popen.
"""

import array
import json
import os
import socket
import subprocess
import threading
import time

from .procs import STUB_MARK, WARM_MARK

PRELOAD = ("torch", "torch.distributed")  # what every warm interpreter imports, before the cluster file's
READY_WAIT = 20.0  # seconds a node's Ready waits for its imports; a rank asked for before they are done starts cold
LINE_MAX = 1 << 20  # bytes of one line from the interpreter (it is the job's Python: bounded)

ROOM_VAR = "DDP_UP_WARM_ROOM"  # the interpreter's last variable: room for its ranks' own in /proc/PID/environ
ROOM = 8192

ZYGOTE = WARM_MARK + r'''
import array, json, os, signal, socket, struct, sys, time


def say(conn, obj):
    try:
        conn and conn.sendall(json.dumps(obj).encode() + b"\n")
    except OSError:
        pass  # a stand-in gone (torchrun killed it): its rank is reaped all the same


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


def listen(path):
    # The socket torchrun's stand-ins ask on (WARM_STUB), in the job's private directory; bound by
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


def asked(listener):
    # (a stand-in's connection, its request with its stdin, stdout and stderr), or None: one of
    # this user's processes only, answered within 10 s.
    conn, _ = listener.accept()
    try:
        conn.settimeout(10)
        uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
        _, extra, _, _ = conn.recvmsg(1, socket.CMSG_SPACE(3 * 4))
        fds = array.array("i")
        for level, kind, data in extra:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
        line = b""
        while not line.endswith(b"\n") and len(line) < (4 << 20):
            chunk = conn.recv(1 << 16)
            if not chunk:
                break
            line += chunk
        if uid != os.getuid() or len(fds) != 3:
            raise ValueError("not a stand-in of this job")
        request = json.loads(line)
        request["fds"] = list(fds)
        conn.settimeout(None)
        return conn, request
    except (OSError, ValueError):
        conn.close()
        return None


def serve(ctl, listener):
    # Fork on request (the agent's, or a stand-in's); tell each asker its rank's end. Returns in a
    # child only, with its request.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    import select
    owners, buffered, open_ = {}, b"", True  # owners: child pid -> the connection that asked for it
    given = array.array("i")
    while open_ or owners:
        askers = [c for c in owners.values() if c is not None and c is not ctl]
        watch = [wake_r] + askers + ([ctl] + ([listener] if listener else []) if open_ else [])
        ready, _, _ = select.select(watch, [], [], 1.0)
        for pid, owner in list(owners.items()):
            if owner in ready and owner in askers and not owner.recv(1):  # the stand-in is gone: torchrun
                owners[pid] = None  # killed it (SIGKILL, past its grace); its rank goes with it, as cold
                owner.close()
                os.kill(pid, signal.SIGKILL)
        if wake_r in ready:
            os.read(wake_r, 4096)
        while owners:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            owner = owners.pop(pid, ctl)
            say(owner, {"ended": pid, "code": -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)})
            if owner is not ctl and owner is not None:
                owner.close()
        requests = []
        if listener in ready:
            requests += [r for r in [asked(listener)] if r]
        if ctl in ready:
            data, extra, _, _ = ctl.recvmsg(1 << 16, socket.CMSG_SPACE(3 * 4))
            for level, kind, fds in extra:  # a launcher's stdio, sent with its request (Warm.fork)
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    given.frombytes(fds[:len(fds) - len(fds) % given.itemsize])
            open_ = bool(data)
            buffered += data
            while b"\n" in buffered:
                line, buffered = buffered.split(b"\n", 1)
                request = json.loads(line)
                if request.get("fds"):
                    request["fds"], given = list(given[:3]), given[3:]
                requests.append((ctl, request))
        for owner, request in requests:
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd in (wake_r, wake_w):
                    os.close(fd)
                for conn in [ctl, listener, owner] + [c for c in owners.values() if c is not None]:
                    if conn is not None:
                        conn.close()
                return request
            for fd in request.get("fds", ()):
                os.close(fd)
            owners[pid] = owner
            say(owner, {"started": request.get("start"), "pid": pid})
    os._exit(0)


def rename(words, name, added):
    # This process as ps, top and /proc show it: the rank's command line and name, and in its
    # /proc/PID/environ, the variables its rank added (RANK first: ddp-kill, the stack dumps and
    # ps -e read them there), written over ROOM_VAR's value, the interpreter's last variable. The
    # interpreter's own variables stay where they are: C code may hold pointers into them.
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)  # PR_SET_NAME
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


def become(request, hook):
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
    first = ("RANK", "LOCAL_RANK")
    added = sorted(((k, v) for k, v in request["env"].items() if before.get(k) != v), key=lambda kv: kv[0] not in first)
    argv = list(request["argv"])
    if argv[0] == "-m":  # python -m MODULE ARGS: the working directory first on the path
        sys.argv, sys.path[0], target = argv[1:], os.getcwd(), argv[1]
    else:
        sys.argv, sys.path[0], target = argv, os.path.dirname(os.path.abspath(argv[0])), os.path.abspath(argv[0])
    rename([sys.executable, "-u"] + argv, os.path.basename(target), added)
    if hook and os.path.isfile(hook):  # ddp-up's sitecustomize of this attempt: its interpreter ran the user's
        with open(hook) as f:
            exec(compile(f.read(), hook, "exec"), {"__name__": "ddp_up_hook", "__file__": hook, "_ddp_up_warm": True})
    return argv[0] == "-m", target


def from_script(kind, value, tb):
    # An uncaught exception's traceback from the script's first frame, as a cold start prints it:
    # without this interpreter's own and runpy's.
    first = tb
    while first is not None and (first.tb_frame.f_code.co_filename == "<string>" or
                                 "runpy" in first.tb_frame.f_code.co_filename):
        first = first.tb_next
    if first is not None and isinstance(value, BaseException):
        tb = first
        value = value.with_traceback(tb)  # what newer Pythons print from
    sys.__excepthook__(kind, value, tb)


def bound_to_agent(agent):
    # Ends with the agent that started it (a SIGKILL from the kernel), however the agent ends.
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG; a fork's child does not inherit it
    except Exception:
        pass
    if os.getppid() != agent:  # gone already
        os._exit(0)


bound_to_agent(int(sys.argv[3]))
ctl = socket.socket(fileno=int(sys.argv[1]))
listener = listen(sys.argv[4])  # before the imports: a stand-in that asks early waits in its queue
prepare(ctl, [n for n in sys.argv[2].split(",") if n])
MODULE, TARGET = become(serve(ctl, listener), sys.argv[5])
sys.excepthook = from_script
del ctl, listener, prepare, serve, become, rename, bound_to_agent, listen, asked
import runpy
if MODULE:
    runpy.run_module(TARGET, run_name="__main__", alter_sys=True)
else:
    runpy.run_path(TARGET, run_name="__main__")
'''.replace("ROOM_VAR", ROOM_VAR)

# torchrun's worker under warm start, in its place: ``python -S -c WARM_STUB SCRIPT ARGS``. It asks
# the node's warm interpreter (its socket: beside PET_LOG_DIR, by attempt) for the rank, with its
# own stdin, stdout and stderr, environment and working directory; passes every signal torchrun or
# ddp-up sends it on to the rank; and ends as the rank ended (its code, or the same signal).
# Without a warm interpreter to answer, it becomes the cold worker itself (exec): torchrun's own
# line, `python -u SCRIPT ARGS`.
WARM_STUB = STUB_MARK + r'''
import array, json, os, signal, socket, sys
here = os.getcwd()
try:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    os.chdir(os.path.dirname(os.environ["PET_LOG_DIR"]))
    s.connect("warm.%s.sock" % os.environ.get("DDP_UP_ATTEMPT", "0"))
    os.chdir(here)
    s.sendmsg([b"\n"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))])
    s.sendall(json.dumps({"argv": sys.argv[1:], "env": dict(os.environ), "cwd": here}).encode() + b"\n")
    answers = s.makefile("rb")
    pid = json.loads(answers.readline())["pid"]
except Exception:
    os.chdir(here)
    os.execv(sys.executable, [sys.executable, "-u"] + sys.argv[1:])
for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2"):
    signal.signal(getattr(signal, name), lambda sig, _: os.kill(pid, sig))
line = answers.readline()
code = json.loads(line)["code"] if line else 1
if code < 0:  # ended by a signal: the stand-in by the same one (SIGKILL's disposition cannot be set)
    -code == signal.SIGKILL or signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
os._exit(code)
'''


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

    def __init__(self, python, env, cwd, log, preload=(), base=PRELOAD, listen="", hook="", report=None):
        names = list(base) + [n for n in preload if n not in base]
        env = dict(env)
        env.pop(ROOM_VAR, None)
        env[ROOM_VAR] = "." * ROOM  # last: see rename in ZYGOTE
        self.sock, theirs = socket.socketpair()
        with open(log, "ab") as err:  # its own errors (a crash while importing): the ranks' go to their logs
            self.proc = subprocess.Popen([python, "-u", "-c", ZYGOTE, str(theirs.fileno()), ",".join(names), str(os.getpid()),
                                          listen, hook],
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
        self.report = report  # report(text): its notices, once, on the job's stderr
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
            for notice in ([self.why_cold()] if "cold" in message else []) + list(message.get("notices") or ()):
                self.report and self.report("ddp-up: warm start: %s\n" % notice)
        elif "started" in message:
            with self.lock:
                child = self.children[message["pid"]] = WarmChild(int(message["pid"]))
                self.started[message["started"]] = child  # a local rank, or None: torchrun
                self.forked.notify_all()
        elif "ended" in message:
            with self.lock:
                child = self.children.get(message["ended"])
            if child is not None:
                child.end(int(message["code"]))

    def ready(self, timeout=READY_WAIT):
        """Whether ranks can be forked: the imports done, CUDA untouched."""
        self.said.wait(timeout)
        return bool(self.hello and "ready" in self.hello)

    def why_cold(self):
        """The one notice for a user whose ranks start cold, or None."""
        if self.hello is None:
            return "the warm interpreter did not get ready; the ranks start cold"
        return "%s; the ranks start cold" % self.hello["cold"] if "cold" in self.hello else None

    def fork(self, local_rank, argv, env, cwd, stdout=None, stderr=None, timeout=30.0, fds=None):
        """A WarmChild running ``argv`` (SCRIPT ARGS) as local rank ``local_rank``; None if the
        interpreter cannot fork it (the caller starts that rank cold)."""
        if not self.ready():  # done already, but for a detached restart's (see run.warm_interpreters)
            return None
        request = {"start": local_rank, "argv": list(argv), "env": dict(env), "cwd": cwd, "stdout": stdout,
                   "stderr": stderr, **({"fds": True} if fds else {})}  # fds: its stdin, stdout, stderr, sent along
        deadline = time.monotonic() + timeout
        with self.lock:
            try:
                line = json.dumps(request).encode() + b"\n"
                sent = self.sock.sendmsg([line[:1]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]) \
                    if fds else 0
                self.sock.sendall(line[sent:])
            except OSError:
                return None
            while local_rank not in self.started and self.proc.poll() is None and time.monotonic() < deadline:
                self.forked.wait(0.5)
            return self.started.pop(local_rank, None)

    def close(self):
        """No more forks: the interpreter exits once its children have (at once without any)."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass


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
