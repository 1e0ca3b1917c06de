"""The warm interpreter's own code (see warm.py for what it is and how the agent talks to it):
ZYGOTE, which imports torch and the cluster file's `preload:` and forks the ranks, and WARM_STUB,
torchrun's worker in its place. Both run as ``python -c`` text on the node, stdlib only, in the
job's own Python; nothing of ddp-up's is importable there.
"""

from .forksafe import FORK_CHECKS
from .warmchild import IN_CHILD
from .procs import STUB_MARK, TORCHRUN, WARM_MARK

ROOM_VAR = "DDP_UP_WARM_ROOM"  # the interpreter's last variable: room for its ranks' own in /proc/PID/environ
ROOM = 8192
SOCKET_VAR = "DDP_UP_WARM_SOCKET"  # torchrun's environment under warm start: where its stand-ins ask
# and the signals they pass on to their rank: those torchrun stops its workers with. Not SIGUSR1 or
# SIGUSR2 unless the job stops with one: ddp-up and Slurm send those to every rank straight, and
# Slurm to every process of its step, the stand-in too (which ignores them, as torchrun does).
PASS_VAR = "DDP_UP_WARM_PASS_ON"

ZYGOTE = WARM_MARK + r'''
import array, gc, json, os, signal, socket, struct, sys, time


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


FORK_CHECKS


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


def serve(ctl, listener):
    # Fork on request (the agent's, or a stand-in's); tell each asker its rank's end. Returns in a
    # child only, with its request.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    import select
    owners, buffered, open_ = {}, b"", True  # owners: child pid -> the connection that asked for it
    pending = {}  # an asker's connection -> [its bound, what it sent so far, its descriptors]
    given = array.array("i")
    while (open_ and not STALE) or owners:
        if listener is not None and STALE:
            listener.close()  # a stand-in that asks now is refused at once, and starts cold
            listener = None
        askers = [c for c in owners.values() if c is not None and c is not ctl]
        watch = [wake_r] + askers + list(pending) + ([ctl] + ([listener] if listener else []) if open_ else [])
        ready, _, _ = select.select(watch, [], [], 1.0 if not pending else 0.25)
        overdue(pending)
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
        if listener is not None and listener in ready:
            let_in(listener, pending)
        for conn in [c for c in ready if c in pending]:
            requests += [r for r in [asked(conn, pending)] if r]
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
            refused = ("STALE", HELLO["cold"]) if STALE else SEEN.refusal(request.get("env") or {})
            if refused:
                if refused[0] == "STALE":
                    went_stale(refused[1])
                refuse(ctl, owner, request, refused[1])
                continue
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd in (wake_r, wake_w):
                    os.close(fd)
                for conn in [ctl, listener, owner] + [c for c in owners.values() if c is not None] + list(pending):
                    if conn is not None:
                        conn.close()
                for _, _, given in pending.values():
                    for fd in given:
                        os.close(fd)
                return request
            for fd in request.get("fds", ()):
                os.close(fd)
            owners[pid] = owner
            say(owner, {"started": request.get("start"), "pid": pid})
    os._exit(0)


IN_CHILD


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
rename([sys.executable, "-u", "-c", "THE_MARK # ddp-up's warm interpreter: torch imported, the ranks forked from it"],
       "ddp-up-warm", None)  # in ps and top, a line and a name, not this whole program
ctl = socket.socket(fileno=int(sys.argv[1]))
listener = listen(sys.argv[4])  # before the imports: a stand-in that asks early waits in its queue
HELLO, SEEN, STALE = {}, Seen(), False
HOME = os.getcwd()  # where it started: its own PYTHONPATH's relative entries are from here
prepare(ctl, [n for n in sys.argv[2].split(",") if n], sys.argv[5] == "keep")
REQUEST = serve(ctl, listener)
MODULE, TARGET = become(REQUEST)
AFTER = REQUEST.get("after")  # torchrun's, on a node other than the master's: the master's store
sys.excepthook = from_script
del ctl, listener, prepare, serve, become, rename, bound_to_agent, listen, asked, REQUEST, SEEN, Seen
import runpy
if MODULE and TARGET == "THE_TORCHRUN":  # torchrun: ddp-up's launcher, never the user's program
    if AFTER:
        await_store(AFTER)
    without_teardown(lambda: runpy.run_module(TARGET, run_name="__main__", alter_sys=True))
else:
    try:
        if MODULE:
            runpy.run_module(TARGET, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(TARGET, run_name="__main__")
    except SystemExit as e:  # raised however (raise SystemExit(3) too): through sys.exit, which
        sys.exit(e.code)  # ddp-up's end watch hears (stacks.END_WATCH), as the script's own end
'''.replace("FORK_CHECKS\n", FORK_CHECKS).replace("IN_CHILD\n", IN_CHILD).replace("ROOM_VAR", ROOM_VAR).replace("THE_MARK", WARM_MARK).replace("THE_TORCHRUN", TORCHRUN)

# torchrun's worker under warm start, in its place: ``python -S -c WARM_STUB SCRIPT ARGS``. It asks
# the node's warm interpreter (its socket: SOCKET_VAR, which torchrun was given) for the rank, with its
# own stdin, stdout and stderr, environment and working directory; passes every signal torchrun or
# ddp-up sends it on to the rank; and ends as the rank ended (its code, or the same signal).
# Without a warm interpreter to answer, it becomes the cold worker itself (exec): torchrun's own
# line, `python -u SCRIPT ARGS`.
WARM_STUB = STUB_MARK + r'''
import array, json, os, signal, socket, sys
here = os.getcwd()
where, passed = os.environ.pop("SOCKET_VAR", ""), os.environ.pop("PASS_VAR", "SIGTERM,SIGINT,SIGHUP,SIGQUIT")
try:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    os.chdir(os.path.dirname(where) or "/nonexistent")
    s.connect(os.path.basename(where))
    os.chdir(here)
    s.sendmsg([b"\n"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))])
    s.sendall(json.dumps({"argv": sys.argv[1:], "env": dict(os.environ), "cwd": here}).encode() + b"\n")
    answers = s.makefile("rb")
    answer = json.loads(answers.readline())
    if "cold" in answer:
        sys.stderr.write("ddp-up: warm start: %s; this rank starts cold\n" % answer["cold"])
        sys.stderr.flush()  # before the exec below: block-buffered on Python 3.8
    pid = answer["pid"]
except Exception:
    os.chdir(here)
    os.execv(sys.executable, [sys.executable, "-u"] + sys.argv[1:])
def pass_on(sig, _):
    try:
        os.kill(pid, sig)
    except OSError:
        pass  # the rank has ended: its status is on its way (its end is not this signal's failure)
for name in passed.split(","):
    signal.signal(getattr(signal, name), pass_on)
line = answers.readline()
if not line:  # the interpreter is gone, and the rank's exit status with it: said, and the rank waited for
    sys.stderr.write("ddp-up: warm start: the warm interpreter that forked this rank is gone; its exit status is lost\n")
    sys.stderr.flush()
    import time
    while True:
        try:
            os.kill(pid, 0)
            with open("/proc/%d/stat" % pid, "rb") as stat:
                if stat.read().rsplit(b")", 1)[-1].split()[:1] == [b"Z"]:
                    break  # ended: its new parent reaps it
        except OSError:
            break
        time.sleep(0.2)
code = json.loads(line)["code"] if line else 1
if code < 0:  # ended by a signal: the stand-in by the same one (SIGKILL's disposition cannot be set)
    -code == signal.SIGKILL or signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
os._exit(code)
'''.replace("SOCKET_VAR", SOCKET_VAR).replace("PASS_VAR", PASS_VAR)
