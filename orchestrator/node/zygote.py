"""The warm interpreter's own code (see warm.py for what it is and how the agent talks to it):
ZYGOTE, which imports torch and the cluster file's `preload:` and forks the ranks, and WARM_STUB,
torchrun's worker in its place. Both run as ``python -c`` text on the node, stdlib only, in the
job's own Python; nothing of ddp-up's is importable there.
"""

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
        try:
            with SEEN.reading(name):
                __import__(name)
        except BaseException as e:  # an ImportError, or whatever the module raised
            if not quiet:  # a job without torch (`launcher: none`) is no news: it runs warm all the same
                notices.append("preload %s failed (%s: %s): the ranks import it themselves" % (name, type(e).__name__, e))
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


def process_state():
    # What an import may change in the process that a forked rank would not get as a cold rank's own
    # import gives it: the environment and sys.path (the rank gets its own), the working directory,
    # signal handlers, umask and rlimits, and the threads.
    import resource
    mask = os.umask(0)
    os.umask(mask)
    handlers = {}
    for sig in signal.valid_signals():
        try:
            handlers[sig] = signal.getsignal(sig)
        except (OSError, ValueError):
            pass
    return {"environment": dict(os.environ), "sys.path": list(sys.path), "working directory": os.getcwd(),
            "signal handlers": handlers, "umask": mask, "threads": native_threads(), "Python threads": python_threads(),
            "rlimits": {n: resource.getrlimit(getattr(resource, n)) for n in dir(resource) if n.startswith("RLIMIT_")}}


def native_threads():
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def python_threads():
    threading = sys.modules.get("threading")
    if threading is None:
        return []
    return sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())


class Seen:
    # What the imports did that a forked rank must be given, or that sends the ranks cold (named):
    #  - the environment variables they set: set again in each rank, where the rank's own value is
    #    the one the import saw (a cold rank's import would set the same);
    #  - the variables they looked for and did not find (RANK, say): a rank that has one forks cold,
    #    unless ddp-up redoes what the module made of it (REDO);
    #  - torch's seed as its import drew it: where no preload seeded it, each rank draws its own;
    #  - the files of every module imported: one that changed means old code, never forked.
    # Anything else it changed in the process (process_state), a thread of Python's, or a thread
    # pool a forked child hangs in (fork_hangs) sends the ranks cold, naming the module.

    def __init__(self):
        self.set, self.missing, self.files, self.threads = {}, {}, {}, 1
        self.torch_seed, self.reseed_torch, self.checked = None, False, 0.0

    def reading(self, name):
        # os.environ's lookups while ``name`` imports: a miss is a name the module looked for
        environ, seen = type(os.environ), self

        class Lookups:
            def __enter__(self):
                self.real = environ.__getitem__

                def getitem(env, key, real=self.real):
                    try:
                        return real(env, key)
                    except KeyError:
                        seen.missing.setdefault(key, set()).add(reader(name))
                        raise
                environ.__getitem__ = getitem

            def __exit__(self, *_):
                environ.__getitem__ = self.real
        return Lookups()

    def after_import(self, name, before, after):
        torch = sys.modules.get("torch")
        if self.torch_seed is None and torch is not None and hasattr(torch, "initial_seed"):
            self.torch_seed = torch.initial_seed()  # as torch's import drew it: never seeded by anyone yet
        env0, env1 = before.pop("environment"), after.pop("environment")
        for key in set(env0) | set(env1):
            if env0.get(key) != env1.get(key):  # (before the first import that changed it, after the last)
                self.set[key] = (self.set.get(key, (env0.get(key),))[0], env1.get(key))
        started = [t for t in after.pop("Python threads") if t not in before.pop("Python threads")]
        if started:
            return ("importing %s started a thread (%s), which a forked rank would not have"
                    % (name, ", ".join(started[:3])))
        grew = after.pop("threads") > before.pop("threads")
        changed = [what for what in sorted(after) if after[what] != before[what]]
        if changed:
            return "importing %s changed the process's %s, which a forked rank would not get" % (name, " and ".join(changed))
        if grew and fork_hangs():
            return ("importing %s left a thread pool (OpenMP's, after a parallel region) that a forked rank "
                    "would hang in" % name)
        return None

    def ready(self):
        torch = sys.modules.get("torch")
        self.reseed_torch = torch is not None and self.torch_seed is not None and torch.initial_seed() == self.torch_seed
        self.threads = native_threads()
        for module in list(sys.modules.values()):
            path = getattr(module, "__file__", None)
            if isinstance(path, str) and path not in self.files:
                try:
                    st = os.stat(path)
                    self.files[path] = (st.st_mtime_ns, st.st_size)
                except OSError:
                    pass
        self.checked = time.monotonic()

    def refusal(self, env):
        # Why a rank with environment ``env`` cannot be forked now, or None.
        if time.monotonic() - self.checked > FILES_FRESH:  # each request's, at most every FILES_FRESH seconds
            for path, (mtime, size) in self.files.items():
                try:
                    st = os.stat(path)
                    if (st.st_mtime_ns, st.st_size) != (mtime, size):
                        return "STALE", "%s changed on disk since the warm interpreter imported it" % path
                except OSError:
                    return "STALE", "%s is gone since the warm interpreter imported it" % path
            self.checked = time.monotonic()
        if python_threads() or native_threads() > self.threads:
            return "THREAD", "a thread started in the warm interpreter after its imports"
        for key in sorted(self.missing):
            readers = self.missing[key] - set(REDO)
            if key in env and readers:
                return "RANK", ("importing %s read %s before any rank had it, and kept what it found"
                                % (sorted(readers)[0], key))
        return None

    def in_rank(self):
        # In the child, its environment the rank's: what a cold rank's imports would have given it.
        for key, (was, now) in self.set.items():
            if os.environ.get(key) == was:
                if now is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = now
        for name, redo in REDO.items():
            if name in sys.modules:
                try:
                    redo(sys.modules[name])
                except Exception:
                    pass
        torch = sys.modules.get("torch")
        if self.reseed_torch:
            torch.default_generator.seed()  # fresh, as a new process's (CUDA's is made in the rank, as cold)
        legacy = sys.modules.get("numpy.random")
        if legacy is not None and hasattr(legacy, "seed"):
            legacy.seed()  # NumPy's global generator, seeded from the OS as its import seeds it


def reader(name):
    # The module whose code looked a variable up (os's and collections.abc's own frames passed over),
    # else the preload being imported.
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__") in ("os", "_collections_abc", "collections.abc"):
        frame = frame.f_back
    return frame.f_globals.get("__name__") or name if frame is not None else name


def rank_zero(module):
    # Lightning: the rank its rank_zero_only decorator compares with, read from the environment at import
    module.rank_zero_only.rank = module._get_rank() or 0


REDO = {"lightning.fabric.utilities.rank_zero": rank_zero, "lightning_fabric.utilities.rank_zero": rank_zero}
FILES_FRESH = 0.5  # seconds a check of the imported modules' files holds for the next request


def fork_hangs(bound=10.0):
    # Whether a child forked now hangs in a thread pool that an import left: torch's intra-op threads
    # (OpenMP's, after one parallel region, hang every forked child's next one), NumPy's BLAS (which
    # stops its own around a fork). Run in a child forked to ask, for ``bound`` seconds at most.
    pid = os.fork()
    if pid == 0:
        try:
            torch = sys.modules.get("torch")
            if torch is not None and hasattr(torch, "ones"):
                torch.set_num_threads(max(2, torch.get_num_threads()))
                torch.ones(256, 256).mm(torch.ones(256, 256))
                torch.ones(1 << 18).add_(1).sum()
            numpy = sys.modules.get("numpy")
            if numpy is not None and hasattr(numpy, "ones"):
                numpy.ones((256, 256)).dot(numpy.ones((256, 256)))
        finally:
            os._exit(0)
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        if os.waitpid(pid, os.WNOHANG)[0]:
            return False
        time.sleep(0.005)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return True


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


def asked(listener):
    # (a stand-in's connection, its request with its stdin, stdout and stderr), or None: one of
    # this user's processes only, answered within 10 s. A kept interpreter's launches ask first
    # whether it is ready ({"hello": 1}, without descriptors): its HELLO answers.
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
        if uid != os.getuid():
            raise ValueError("not this user's")
        request = json.loads(line)
        if request.get("hello") and not len(fds):
            stale = "ready" in HELLO and SEEN.refusal({})
            if stale and stale[0] == "STALE":
                went_stale(stale[1])
            say(conn, HELLO)
            raise ValueError("answered")
        if len(fds) != 3 or "cold" in HELLO:
            for fd in fds:
                os.close(fd)
            raise ValueError("not a stand-in's request, or nothing to fork from")
        request["fds"] = list(fds)
        conn.settimeout(None)
        return conn, request
    except (OSError, ValueError):
        conn.close()
        return None


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
    given = array.array("i")
    while (open_ and not STALE) or owners:
        if listener is not None and STALE:
            listener.close()  # a stand-in that asks now is refused at once, and starts cold
            listener = None
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
        if added is None:  # the interpreter's own name: its environment keeps the room for its ranks'
            return
        start, end = int(fields[47]), int(fields[48])  # env_start, env_end
        at = ctypes.string_at(start, end - start).rfind(b"\0ROOM_VAR=") + 1
        if at > 0:
            text = b"".join(b"%s=%s\0" % (k.encode(), v.encode()) for k, v in added
                            if len(k) + len(v) + 2 < end - start - at)
            ctypes.memmove(start + at, (text + b"\0" * (end - start - at))[:end - start - at], end - start - at)
    except Exception:
        pass  # a name is never worth a rank


def repath(mine, theirs):
    # sys.path as the rank's own PYTHONPATH makes it in a cold start (ddp-up's hooks, the Python
    # API's function runner, the user's own): right after the script's folder, in place of the
    # interpreter's, each entry made absolute from the rank's working directory (an empty one is
    # that directory) and each path kept once, as Python's site does (3.8 to 3.13 alike).
    # Returns the sitecustomize a cold start would have run that this interpreter did not: the
    # first on the rank's own part of the path (ddp-up's hook of the attempt), or None.
    gone = {os.path.normpath(os.path.join(HOME, p)) for p in mine.split(os.pathsep)} if mine else set()
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


def become(request):
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
    SEEN.in_rank()  # the imports' variables, fresh randomness, what Lightning read of the rank
    first = ("RANK", "LOCAL_RANK")
    added = sorted(((k, v) for k, v in request["env"].items() if before.get(k) != v), key=lambda kv: kv[0] not in first)
    hook = repath(before.get("PYTHONPATH", ""), request["env"].get("PYTHONPATH", ""))
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
'''.replace("ROOM_VAR", ROOM_VAR).replace("THE_MARK", WARM_MARK).replace("THE_TORCHRUN", TORCHRUN)

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
code = json.loads(line)["code"] if line else 1
if code < 0:  # ended by a signal: the stand-in by the same one (SIGKILL's disposition cannot be set)
    -code == signal.SIGKILL or signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
os._exit(code)
'''.replace("SOCKET_VAR", SOCKET_VAR).replace("PASS_VAR", PASS_VAR)
