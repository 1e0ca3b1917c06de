"""The node agent: ddp-up ships this file's source to every node over the session's stdin.

It needs nothing but the node's Python (stdlib only, 3.8+). In ``run`` mode it preflights the
node, waits for the controller's go, starts the launcher in its own session with the job's tag
in its environment (for ``launcher: none`` it starts the workers itself: see Workers), relays
output as frames, and stops the whole job on that node when the controller asks, when the
controller's connection closes, or when the controller's heartbeat stops (the dead-man switch
that covers network partitions and sleeping laptops). In ``sweep`` mode it finds tagged
processes and stops them (the same code path ddp-kill uses). In ``detect`` mode it reports what
planning needs to know of the node (its GPU count, for ``gpus: auto``). In ``sync`` mode it
receives the changed files of the workdir copy (see sync.py).

The wire protocol (every frame, both directions, every mode) is defined once, in wire.py, which
the controller ships to the node ahead of this file with nodefacts.py (what the node's network
and GPUs look like), each as source and as bytecode; a bootstrap (BOOTSTRAP) registers them as
``ddp_up_wire`` and ``ddp_up_nodefacts``.

Worker output: torchrun redirects every worker's stdout/stderr to files (``--redirects=3``) and a
tailer thread relays them in chunks. Workers write to a local file exactly as if nobody watched,
a slow controller never blocks them, the files are the node's own copy of the log, and the node
spends no per-line work (torchrun's ``--tee`` re-prints every line from a Python thread).
"""

import errno
import itertools
import json
import os
import queue
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time

try:
    from . import nodefacts, wire  # imported by the controller, as part of the package
except ImportError:  # running on a node: the bootstrap registered the shipped modules under these names
    import ddp_up_nodefacts as nodefacts
    import ddp_up_wire as wire

TAG_JOB = "DDP_UP_JOB"
TAG_NODE = "DDP_UP_NODE"
TAG_CLUSTER = "DDP_UP_CLUSTER"
TAG_RUN = "DDP_UP_RUN"  # one launch: a job's own cleanup matches it too, so it can never touch another
TAG_ATTEMPT = "DDP_UP_ATTEMPT"  # 0, then 1, 2... as a job restarts (restarts:); a script resumes by it
TAGS = (TAG_JOB, TAG_NODE, TAG_CLUSTER, TAG_RUN, TAG_ATTEMPT)
# A job id names directories here and on the controller: a plain name, never a path.
JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# Turns what the controller sends first on stdin into the running agent. argv[1] is the
# controller's bytecode key (cache tag and magic number); argv[2:8] are the sizes of wire.py,
# nodefacts.py, this file, then the three compiled by the controller (marshal). When the node's
# Python has the same key it runs the compiled code (compiling is a quarter of the agent's
# start-up, paid per node), else it compiles the sources. wire.py and nodefacts.py become the
# modules ddp_up_wire and ddp_up_nodefacts, this file the main program. The leading string names
# the agent early in its command line (ps, /proc/PID/cmdline cut at 200 characters).
BOOTSTRAP = ("'ddp_up_agent';import sys,types,marshal;a=sys.argv;r=sys.stdin.buffer.read;s=[r(int(n)) for n in a[2:8]];"
             "k='%s%s'%(sys.implementation.cache_tag,getattr(sys.modules.get('_frozen_importlib_external'),"
             "'MAGIC_NUMBER',b'').hex());c=lambda i,n:marshal.loads(s[i+3]) if a[1]==k and s[i+3] else "
             "compile(s[i],n,'exec');m=sys.modules;[m.__setitem__(n,types.ModuleType(n)) or exec(c(i,n),m[n].__dict__) "
             "for i,n in enumerate(('ddp_up_wire','ddp_up_nodefacts'))];exec(c(2,'ddp_up_agent'))")
AGENT_MARK = "'ddp_up_agent';"  # how an agent's command line starts (see BOOTSTRAP)
# `launcher: none`: the first word of the Go argv that asks this agent to start the workers itself
# (``OWN_LAUNCHER --name=value... SCRIPT ARGS``), with no launcher process between them.
OWN_LAUNCHER = "ddp-up-launch"
KILL_WAIT = 3.0  # after SIGKILL, how long to wait for the kernel to reap before reporting
# Stack dumps on request, without changing the user's script: a sitecustomize first on the
# workers' PYTHONPATH registers faulthandler for a real-time signal (SIGUSR1 is often the
# application's own, e.g. for requeueing) and then loads any other sitecustomize on the path.
DUMP_SIGNAL = signal.SIGRTMIN + 7
PYSPY_TIMEOUT = 20.0  # seconds for one py-spy dump
GPU_SAMPLE = 5.0  # seconds between GPU samples for the dashboard (nvidia-smi costs ~50 ms of CPU)
DUMP_HOOK = """import faulthandler, importlib.machinery, importlib.util, os, sys
faulthandler.register(%d, all_threads=True, chain=False)  # ddp-up: stack dump when a job looks hung
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", sys.path)  # the one we shadow, if any
if _spec is not None and _spec.loader is not None:
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
""" % DUMP_SIGNAL


# --- finding and signalling the job's processes -------------------------------------------------

def read_tags(pid):
    """The ddp-up tags in a process's initial environment, or None if it has none/is gone."""
    try:
        with open("/proc/%d/environ" % pid, "rb") as f:
            raw = f.read()
    except OSError:
        return None
    if b"DDP_UP_JOB=" not in raw:  # most processes: no tags, and no per-variable work (a /proc scan
        return None  # reads every process's environment, on every agent's start and end)
    tags = {}
    for item in raw.split(b"\0"):
        if item.startswith(b"DDP_UP_"):
            key, _, value = item.partition(b"=")
            name = key.decode("ascii", "replace")
            if name in TAGS:
                tags[name] = value.decode("utf-8", "replace")
    return tags if TAG_JOB in tags else None


def read_environ_value(pid, name):
    try:
        with open("/proc/%d/environ" % pid, "rb") as f:
            for item in f.read().split(b"\0"):
                if item.startswith(name + b"="):
                    return item[len(name) + 1:].decode("ascii", "replace")
    except OSError:
        pass
    return None


def catches(pid, sig):
    """Whether the process has a handler for ``sig`` (so the signal cannot kill it)."""
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (int(sig) - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def is_alive(pid):
    """True unless gone or a zombie (a reaper may collect orphans a second or two late)."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:][:1] not in (b"Z", b"X", b"")


def _cmdline(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except OSError:
        return ""


def find_tagged(match):
    """Live processes of this user whose tags include every (key, value) in ``match``."""
    me, uid = os.getpid(), os.getuid()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        pid = int(name)
        try:
            if os.stat("/proc/%d" % pid).st_uid != uid:
                continue
        except OSError:
            continue
        tags = read_tags(pid)
        if tags is None or any(tags.get(k) != v for k, v in match.items()):
            continue
        if is_alive(pid):
            found.append({"pid": pid, "tags": tags, "cmd": _cmdline(pid)[:200]})
    return found


def signal_tagged(pid, sig, match):
    """Send ``sig`` to ``pid`` only if it still carries the tags in ``match``.

    With pidfd (Linux 5.3+, Python 3.9+) the pid is pinned before the tags are re-read, so a
    recycled pid can never receive the signal.
    """
    fd = None
    try:
        if hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal"):
            fd = os.pidfd_open(pid)
        tags = read_tags(pid)
        if tags is None or any(tags.get(k) != v for k, v in match.items()):
            return False
        if fd is not None:
            signal.pidfd_send_signal(fd, sig)
        else:
            os.kill(pid, sig)
        return True
    except OSError:  # gone already, or not ours to signal
        return False
    finally:
        if fd is not None:
            os.close(fd)


def wait_gone(pids, timeout):
    """Poll /proc until none of ``pids`` is alive or the timeout passes; return survivors."""
    deadline = time.monotonic() + timeout
    left = [p for p in pids if is_alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if is_alive(p)]
    return left


def kill_tagged(match, grace, first_signal=signal.SIGTERM):
    """SIGTERM (or ``first_signal``) every matching process, wait ``grace``, SIGKILL survivors."""
    procs = find_tagged(match)
    pids = [p["pid"] for p in procs]
    sent = [pid for pid in pids if signal_tagged(pid, first_signal, match)]
    survivors = wait_gone(sent, grace) if first_signal != signal.SIGKILL else sent
    killed = [pid for pid in survivors if signal_tagged(pid, signal.SIGKILL, match)]
    left = wait_gone(killed, KILL_WAIT)
    return {"found": procs, "killed": killed, "left": left}


# --- node-side state: private, never through a link --------------------------------------------
#
# $TMPDIR/ddp-up-$UID/               this user's, 0700, checked (never created through a link)
#   <job>/                           0700
#     node<N>/                       created exclusively: a job id already in use here is refused
#       hooks/                       files the job runs (stack-dump hook, launcher), 0600
#       logs/                        torchrun's per-worker log files, relayed by the Tailer

def state_root():
    return os.path.join(tempfile.gettempdir(), "ddp-up-%d" % os.getuid())


def private_dir(path, create=True):
    """None if ``path`` is (now) a real directory of this user's that no one else can enter;
    else what is wrong with it. Never follows a link: a directory that another local user made,
    replaced or pointed elsewhere first is refused, not used. One of this user's that others may
    only read (earlier versions made it 0755) is tightened to 0700; one others could write into
    may hold anything, and is refused."""
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as e:
            return "cannot be created (%s)" % (e.strerror or e)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            return "is a symbolic link or not a directory"
        return "cannot be opened (%s)" % (e.strerror or e)
    try:
        st = os.fstat(fd)
        mode = stat.S_IMODE(st.st_mode)
        if st.st_uid != os.getuid():
            return "belongs to uid %d, not to this user (uid %d)" % (st.st_uid, os.getuid())
        if mode & 0o022:
            return "is writable by other users (mode %03o)" % mode
        if mode & 0o077:
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)
    return None


def unsafe_state(path, why):
    return wire.Failed("ddp-up's state directory %s %s; refusing to use it" % (path, why),
                       "if you made it, remove it (rm -rf %s); if another user did, ask an admin to, or give the "
                       "agent a private TMPDIR with `setup: export TMPDIR=$HOME/.cache/ddp-up-tmp`" % path)


def per_attempt(name, attempt):
    """What a later attempt of a restarted job has of its own is named ``<name>.<attempt>``:
    ddp-up's attempts get node directories (``node<N>.<attempt>``: the one before may still be
    ending on this host), a detached job's a journal and a torchrun log directory each."""
    return name if not attempt else "%s.%d" % (name, attempt)


def node_dir_name(node, attempt=0):
    return per_attempt("node%d" % node, attempt)


def parse_node_dir(entry):
    """The tags a node directory's processes carry ({TAG_NODE[, TAG_ATTEMPT]}), or None if the
    name is not one ddp-up gives."""
    found = re.fullmatch(r"node([0-9]+)(?:\.([0-9]+))?", entry)
    if not found:
        return None
    tags = {TAG_NODE: found.group(1)}
    if found.group(2):
        tags[TAG_ATTEMPT] = found.group(2)
    return tags


def claim_node_dir(job, node, attempt=0):
    """(the node's state directory, None), or (None, Failed): the job's id is in use here, or
    the state root is not private."""
    root = state_root()
    for path in (root, os.path.join(root, job)):
        why = private_dir(path)
        if why:
            return None, unsafe_state(path, why)
    path = os.path.join(root, job, node_dir_name(node, attempt))
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        return None, job_in_use(job, "its state directory %s exists" % path)
    except OSError as e:
        return None, unsafe_state(path, "cannot be created (%s)" % (e.strerror or e))
    return path, None


def job_in_use(job, why):
    return wire.Failed("job id %s is already in use on this node (%s)" % (job, why),
                       "pick another --job-id, or stop the other one first: ddp-kill CLUSTER.yaml --job %s" % job)


def write_private(path, text):
    """A new file of ours, 0600, never through a link or over an existing file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


# --- output to the controller -------------------------------------------------------------------

class Writer:
    """One thread owns stdout, so the main loop never blocks on a stalled connection."""

    def __init__(self, stream):
        self.stream = stream
        self.items = queue.Queue(maxsize=4096)
        self.idle = threading.Event()
        self.broken = False
        self.last_activity = time.monotonic()  # last line queued or written
        threading.Thread(target=self._loop, name="writer", daemon=True).start()

    journal = None  # detach: a Journal that keeps every frame after Go (heartbeats aside)
    last_output = time.monotonic()  # when a rank's line last went out (a detached job's hang watch)

    def send(self, frame, block=True):
        data = frame.encode()
        if type(frame) is wire.Output and frame.rank is not None:
            self.last_output = time.monotonic()
        if self.journal is None or isinstance(frame, wire.Heartbeat):
            self.put(data, block)
            return
        with self.journal.lock:  # one order for the file and the stream
            self.journal.append(data)
            self.put(data, block)

    def put(self, data, block=True):
        self.idle.clear()
        self.last_activity = time.monotonic()
        while not self.broken:  # gone (or given up on, see Runner.tick): nothing more is queued
            try:
                self.items.put(data, block=block, timeout=1.0 if block else None)
                return
            except queue.Full:
                if not block:
                    return  # only heartbeats are sent without blocking; a dropped one is harmless
        self.idle.set()

    def drain(self, stall_timeout):
        """Wait until everything queued is written, as long as writing makes progress."""
        while not self.idle.wait(0.5):
            if time.monotonic() - self.last_activity > stall_timeout:
                return False
        return True

    def _loop(self):
        while True:
            chunks = [self.items.get()]
            while True:
                try:
                    chunks.append(self.items.get_nowait())
                except queue.Empty:
                    break
            if not self.broken:
                try:
                    self.stream.write(b"".join(chunks))
                    self.stream.flush()
                    self.last_activity = time.monotonic()
                except OSError:
                    self.broken = True  # controller gone; stdin EOF will stop the job
            if self.items.empty():
                self.idle.set()


def join_while_moving(thread, writer, stall_timeout):
    """Wait for a relaying thread to end, as long as the writer keeps making progress."""
    while thread.is_alive():
        thread.join(0.5)
        if time.monotonic() - writer.last_activity > stall_timeout:
            return


MAX_PIECE = 1 << 20  # a line longer than this goes out in pieces (the controller joins them again)


def whole_lines(buffered, flush):
    """Split ``buffered`` bytes into (what to send now, what to keep): whole lines, all of a line
    past MAX_PIECE, and everything at the end (``flush``). Nothing is added or dropped."""
    cut = buffered.rfind(b"\n") + 1
    if flush or (cut == 0 and len(buffered) >= MAX_PIECE):
        cut = len(buffered)
    return buffered[:cut], buffered[cut:]


def pump(fd, stream, writer):
    """Relay the launcher's own stream to the controller: the whole lines of each read, one frame."""
    rest = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError as e:
            if e.errno == errno.EINTR:
                continue
            chunk = b""
        send, rest = whole_lines(rest + chunk, flush=not chunk)
        if send:
            writer.send(wire.Output(stream, None, send))
        if not chunk:
            os.close(fd)
            return


def subdirs(path, keep):
    try:
        with os.scandir(path) as entries:
            return [e.path for e in entries if keep(e.name) and e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def worker_logs(log_dir):
    """(path, stream, local rank) of every ``<run>/attempt_<n>/<local_rank>/std{out,err}.log``
    under log_dir. A walk of three levels, not glob: glob (with fnmatch) is a tenth of the
    agent's imports."""
    found = []
    for run in subdirs(log_dir, lambda name: True):
        for attempt in subdirs(run, lambda name: name.startswith("attempt_")):
            for rank in subdirs(attempt, lambda name: name.isascii() and name.isdigit()):
                for name, stream in (("stdout.log", "out"), ("stderr.log", "err")):
                    path = os.path.join(rank, name)
                    if os.path.isfile(path):
                        found.append((path, stream, int(os.path.basename(rank))))
    return found


class Tailer:
    """Relays the workers' log files to the controller in whole-line chunks, one per read.

    The files are torchrun's ``<log_dir>/<run>/attempt_<n>/<local_rank>/std{out,err}.log``.
    Polled, not watched: inotify is not in the stdlib, and a poll every POLL seconds costs
    nothing next to a print-heavy job while batching its lines into few frames.
    """

    POLL = 0.05
    RESCAN = 0.5  # new attempts (restarts) appear rarely
    CHUNK = 1 << 16
    BACKLOG = 32  # frames queued to the controller before reading pauses (bounds memory)

    def __init__(self, log_dir, writer):
        self.log_dir = log_dir
        self.out = writer
        self.files = {}  # path -> [fd, stream, local_rank, partial bytes]
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, name="tailer", daemon=True)

    def start(self):
        self.thread.start()

    def finish(self, stall_timeout):
        """After the workers are gone: relay what is left, as long as relaying makes progress."""
        self.done.set()
        join_while_moving(self.thread, self.out, stall_timeout)

    def run(self):
        scanned = 0.0
        while True:
            last = self.done.is_set()  # read before the final pass, so nothing written before it is missed
            if last or time.monotonic() - scanned > self.RESCAN:
                self.scan()
                scanned = time.monotonic()
            moved = self.relay_all(flush=last)
            if last:
                return
            if not moved:
                self.done.wait(self.POLL)

    def scan(self):
        for path, stream, local_rank in worker_logs(self.log_dir):
            if path not in self.files:
                try:
                    self.files[path] = [os.open(path, os.O_RDONLY), stream, local_rank, b""]
                except OSError:
                    continue

    def relay_all(self, flush):
        moved = False
        for entry in self.files.values():
            moved = self.relay(entry, flush) or moved
        return moved

    def relay(self, entry, flush):
        fd, stream, local_rank, partial = entry
        moved = False
        while True:
            while self.out.items.qsize() > self.BACKLOG and not self.out.broken:
                time.sleep(0.01)  # the controller is slower than the job: the file holds the rest
            data = os.read(fd, self.CHUNK)
            if not data:
                break
            moved = True
            send, partial = whole_lines(partial + data, flush=False)
            if send:
                self.send(stream, local_rank, send)
        if flush and partial:
            self.send(stream, local_rank, partial)  # the unterminated end, as it is
            partial = b""
        entry[3] = partial
        return moved

    def send(self, stream, local_rank, data):
        self.out.send(wire.Output(stream, local_rank, data))


# --- run mode -----------------------------------------------------------------------------------

class Runner:
    """Run mode: preflight, wait for Go, start the launcher, relay, stop on request or silence."""

    def __init__(self, spec, writer):
        self.spec = spec  # a wire.RunSpec
        self.out = writer
        self.match = {TAG_JOB: spec.job, TAG_NODE: str(spec.node), TAG_RUN: spec.run}  # this launch only
        self.events = queue.SimpleQueue()  # put() is safe from signal handlers
        self.last_heard = time.monotonic()
        self.proc = None
        self.pumps = []
        self.tailer = None
        self.listener = None
        self.answering = None  # the thread that answers probes while the listener is held
        self.torch = None  # {"torch", "cuda", "nccl"} once probed
        self.dir = None  # this node's private state directory, once claimed
        self.log_dir = None
        self.supervisor = None  # detach, the master node: the Supervisor the other nodes join
        self.link = None  # detach, the other nodes: their PeerLink to it
        self.record = None  # detach: this node's record (see write_record)
        self.ended = threading.Event()  # the job is over here: samplers stop
        self.attempt = spec.attempt  # detach with restarts: the supervisor starts the later ones (Restart)
        # stopped for good, no restart: a signal to this agent (ddp-kill, a shutdown), the controller's
        # Stop, or its supervisor gone silent; a Halt (another node's failure) is not
        self.for_good = False
        self.next_go = None  # detach with restarts: the Go of the attempt to start next
        self.first_go = None  # detach: attempt 0's Go, whose launch line every later attempt reuses

    def on_signal(self, signum, _frame):
        self.for_good = True
        self.events.put(("stop", "agent got " + signal.Signals(signum).name))

    def run(self):
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(sig, self.on_signal)
        problem = self.preflight()
        if problem:
            self.cleanup_state(keep_logs=False)
            self.out.send(problem)
            self.out.drain(5)
            return 3
        self.out.send(wire.Ready(
            hostname=socket.gethostname(), python=sys.version.split()[0], torch=self.torch.get("torch"),
            cuda=self.torch.get("cuda"), nccl=self.torch.get("nccl"), gpus=count_gpus(self.job_env()),
            time=time.time(), disk_free=shutil.disk_usage(".").free,
            port=None if self.listener is None else self.listener.getsockname()[1],
            supervisor_port=None if self.supervisor is None else self.supervisor.port,
            busy_gpus=nodefacts.query_busy_gpus(self.job_env().get("CUDA_VISIBLE_DEVICES"), self.spec.nproc) or None))
        threading.Thread(target=self.read_controller, name="stdin", daemon=True).start()
        kind, arg = self.wait_for_go()
        if kind != "go":
            self.cleanup_state(keep_logs=False)
            self.out.send(wire.Exited(code=None, signal=None, stopped=True, reason=arg))
            self.out.drain(5)
            return 0
        self.start(arg)
        if self.spec.detach:
            self.detach(arg)
        while True:
            code = self.supervise()
            if self.next_go is None:
                return code
            self.begin_attempt(self.next_go)

    def preflight(self):
        """None, or the Failed frame that says what is wrong here and how to fix it."""
        workdir = os.path.expanduser(self.spec.workdir or "~")
        if not os.path.isdir(workdir):
            return wire.Failed("workdir %s does not exist" % workdir,
                               "create it on this node, or set `workdir:` in the cluster file")
        os.chdir(workdir)
        script = self.spec.script
        if script and not os.path.isfile(script):
            return wire.Failed("script %s not found in %s" % (script, workdir),
                               "copy it to this node, or set `workdir:` to the directory that holds it")
        # a process per node, paid N times on a big cluster: only where the launcher needs torch
        self.torch = probe_torch(self.job_env()) if self.spec.needs_torch else {}
        if self.torch is None:
            return wire.Failed("torch is not installed for %s (Python %s)" % (sys.executable, sys.version.split()[0]),
                               "install torch on this node, or set `python:` to an interpreter that has it")
        problem = self.claim_state()
        if problem:
            return problem
        port = self.spec.check_port
        if port or self.spec.pick_port:
            try:  # held until go: reserves the port and lets every node probe the master for real
                self.listener = listen_on(port or 0)
                self.answering = threading.Thread(target=answer_probes, args=(self.listener,), name="probes",
                                                  daemon=True)
                self.answering.start()
            except OSError:
                return wire.Failed("master port %d is already in use on the master node" % port,
                                   "set `master: {port: auto}` or pick another port")
        if self.spec.detach and (port or self.spec.pick_port):
            self.supervisor = Supervisor(self, listen_on(0))
        return None

    def job_env(self):
        return job_env(self.spec.env)

    def claim_state(self):
        """This node's private state directory, created exclusively: a job id in use here (a
        directory, or live processes of it) is refused before anything starts."""
        job, node = self.spec.job, self.spec.node
        if not JOB_ID.fullmatch(job):
            return wire.Failed("job id %r is not a plain name" % job[:80], "use the same ddp-up version everywhere")
        others = find_tagged({TAG_JOB: job, TAG_NODE: str(node), TAG_ATTEMPT: str(self.spec.attempt)})
        if others:
            return job_in_use(job, "pid %d carries its tags" % others[0]["pid"])
        self.dir, problem = claim_node_dir(job, node, self.spec.attempt)
        if problem:
            return problem
        self.log_dir = os.path.join(self.dir, "logs")
        return None

    def probe(self, target):
        """Can this node open a TCP connection to the master's address and port? With the
        interfaces that route there (see nodefacts.network_facts)."""
        facts = nodefacts.network_facts(target.addr, self.job_env())
        try:
            socket.create_connection((target.addr, target.port), timeout=target.timeout).close()
            self.out.send(wire.Probed(ok=True, **facts))
        except OSError as e:
            self.out.send(wire.Probed(ok=False, error=e.strerror or str(e) or type(e).__name__, **facts))

    COMMANDS = {wire.Go: "go", wire.Stop: "stop", wire.Kill: "kill", wire.Probe: "probe", wire.Dump: "dump"}

    def read_controller(self):
        """The controller's frames, as events; a frame that is not one stops the job."""
        while True:
            try:
                frame = wire.read_frame(sys.stdin.buffer)
            except wire.ProtocolError as e:
                self.events.put(("stop", "protocol error from the controller: %s" % e))
                return
            except (OSError, ValueError):
                frame = None
            if frame is None:
                break
            self.last_heard = time.monotonic()
            kind = self.COMMANDS.get(type(frame))
            if kind == "go":
                self.events.put((kind, frame))
            elif kind == "probe":
                self.events.put((kind, frame))
            elif kind is not None:
                self.events.put((kind, "controller asked"))
            elif not isinstance(frame, wire.Heartbeat):
                self.events.put(("stop", "protocol error from the controller: %s in run mode" % type(frame).__name__))
                return
        self.events.put(("controller gone", "controller connection closed"))

    def tick(self):
        """Heartbeat both ways; returns a stop event once the controller has gone quiet (a
        detached job's liveness is the supervisor's business, see PeerLink)."""
        self.out.send(wire.Heartbeat(), block=False)
        silent = time.monotonic() - self.last_heard
        if silent > self.spec.orphan_timeout:
            if not self.detached():
                return ("stop", "no heartbeat from the controller for %.0f s" % silent)
            self.out.broken = True  # a partitioned controller: its stream would block, the journal has it all
        return None

    def detached(self):
        return self.spec.detach and (self.link is not None or self.supervisor is not None)

    def next_event(self):
        try:
            return self.events.get(timeout=self.spec.heartbeat)
        except queue.Empty:
            return self.tick()

    def wait_for_go(self):
        while True:
            event = self.next_event()
            if event and event[0] == "probe":
                threading.Thread(target=self.probe, args=(event[1],), daemon=True).start()
            elif event and event[0] == "controller gone":
                self.close_listener()
                return "stop", event[1]
            elif event and event[0] in ("go", "stop", "kill"):
                self.close_listener()
                if event[0] == "go" and self.spec.detach and not (self.supervisor or event[1].supervisor):
                    return "stop", "protocol error from the controller: a detached Go without its supervisor"
                return event

    def close_listener(self):
        if self.listener is not None:
            try:
                self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept in answer_probes
            except OSError:
                pass
            self.listener.close()
            self.listener = None
            if self.answering is not None:
                # the probe being answered ends too: no socket of ours is left on the port for torchrun
                self.answering.join(PROBE_CLOSE_WAIT)

    def start(self, go):
        argv = go.argv
        if self.spec.detach:  # before the first frame of the job: the journal has them all
            self.out.journal = Journal(os.path.join(self.dir, per_attempt(JOURNAL, self.attempt)))
        env = self.job_env()
        env.update(go.env or {})
        env.update({TAG_JOB: self.spec.job, TAG_NODE: str(self.spec.node), TAG_CLUSTER: self.spec.cluster,
                    TAG_RUN: self.spec.run, TAG_ATTEMPT: str(self.attempt)})
        env["PET_LOG_DIR"] = self.log_dir  # torchrun --log-dir, kept out of the user's workdir
        hooks = dict(self.spec.hooks or {})
        if self.spec.stack_dumps:
            hooks["sitecustomize.py"] = DUMP_HOOK
        if hooks:
            where = self.write_hooks(hooks)
            env["PYTHONPATH"] = where + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        if argv[0] == OWN_LAUNCHER:
            self.proc = Workers(parse_launch(argv[1:]), env, self.match,
                                lambda text: self.out.send(wire.Output("err", None, text.encode())))
            self.proc.start(self.log_dir)
            self.out.send(wire.Started())
        else:
            self.start_launcher(argv, env)
        self.tailer = Tailer(self.log_dir, self.out)
        self.tailer.start()
        if nodefacts.has_nvidia_gpus():
            threading.Thread(target=self.sample_gpus, name="gpus", daemon=True).start()
        proc, attempt = self.proc, self.attempt  # an attempt's end is told apart from a later one's
        threading.Thread(target=lambda: self.events.put(("exited", (attempt, proc.wait()))), daemon=True).start()

    def start_launcher(self, argv, env):
        # The plan names the node's python as configured (``~/venv/bin/python``, ``python3``); this
        # agent runs under exactly that interpreter, already resolved by the shell that started it.
        argv = [sys.executable if a == argv[0] else a for a in argv]
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, start_new_session=True)
        self.out.send(wire.Started())
        for pipe, stream in ((self.proc.stdout, "out"), (self.proc.stderr, "err")):
            t = threading.Thread(target=pump, args=(os.dup(pipe.fileno()), stream, self.out), daemon=True)
            pipe.close()
            t.start()
            self.pumps.append(t)

    def write_hooks(self, files):
        """Files of ours the job runs (the dump hook, ddp-check's probe), {name: text}, in this
        node's state directory; that directory, for the job's PYTHONPATH."""
        hooks = os.path.join(self.dir, "hooks")
        try:
            os.mkdir(hooks, 0o700)
        except FileExistsError:
            pass
        for name, text in files.items():
            write_private(os.path.join(hooks, os.path.basename(name)), text)  # a name, never a path
        return hooks

    def detach(self, go):
        """From now on the job needs no controller: its record says it runs, its agents watch
        each other (the master node's Supervisor), and a closed controller connection or a
        SIGHUP (a terminal closing) no longer stops it."""
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        self.out.last_output = time.monotonic()  # the hang watch counts from the start, as ddp-up's does
        self.first_go = go
        self.record = {"job": self.spec.job, "node": self.spec.node, "label": self.spec.label,
                       "script": self.spec.script, "ranks": self.spec.ranks, "pid": os.getpid(),
                       "started": time.time(), "ended": None, "state": "running", "code": None, "reason": None,
                       "retention": self.spec.retention, "attempt": self.attempt}
        write_record(self.dir, self.record)
        remove_stale_state({}, records_only=True)  # finished detached jobs past their retention, here
        if self.supervisor is not None:
            self.supervisor.start()
            self.supervisor.report(self.spec.node, "running")
        else:
            addr, port = go.supervisor
            self.link = PeerLink(self, addr, int(port))
            self.link.start()

    def supervise(self):
        while True:
            event = self.next_event()
            if event is None:
                continue
            kind, arg = event
            if kind == "controller gone":
                if self.detached():
                    self.out.broken = True
                    continue  # the point of detaching
                kind = "stop"
            if kind == "dump":
                self.dump_stacks()
                continue
            if kind == "exited" and arg[0] == self.attempt:
                return self.finish(arg[1], stopped=False, reason=None)
            if kind == "halt" and arg[0] == self.attempt:  # the supervisor's, for this attempt
                return self.stop(arg[1], force=False)
            if kind in ("stop", "kill"):
                self.for_good = True
                return self.stop(arg, force=(kind == "kill"))

    def dump_stacks(self):
        """Every worker's Python stack into its stderr stream, then Dumped: with py-spy where the
        job's PATH has it (no hook needed, works on any frame), else by the dump hook's signal.
        On a thread, so heartbeats go on while py-spy attaches."""
        threading.Thread(target=self._dump_stacks, name="dump", daemon=True).start()

    def _dump_stacks(self):
        pyspy = shutil.which("py-spy", path=self.job_env().get("PATH", os.defpath))
        workers = []
        for proc in find_tagged(self.match):
            rank = read_environ_value(proc["pid"], b"RANK")
            local = read_environ_value(proc["pid"], b"LOCAL_RANK")
            if rank is not None and local is not None:
                workers.append((proc["pid"], int(rank), int(local)))
        results = {}
        threads = [threading.Thread(target=lambda w=w: results.__setitem__(w, self.dump_one(pyspy, *w)), daemon=True)
                   for w in workers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(PYSPY_TIMEOUT + 5)
        self.out.send(wire.Dumped(ranks=sorted(rank for (_, rank, _), ok in results.items() if ok)))

    def dump_one(self, pyspy, pid, rank, local_rank):
        if pyspy:
            try:
                done = subprocess.run([pyspy, "dump", "--pid", str(pid)], stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=PYSPY_TIMEOUT)
                if done.returncode == 0:
                    text = b"ddp-up: py-spy dump of pid %d (rank %d)\n" % (pid, rank) + done.stdout.rstrip(b"\n")
                    self.tailer.send("err", local_rank, text + b"\n")  # as if the worker printed it
                    return True
            except (OSError, subprocess.SubprocessError):
                pass  # e.g. ptrace not allowed here: fall back to the hook
        return catches(pid, DUMP_SIGNAL) and signal_tagged(pid, DUMP_SIGNAL, self.match)

    def stop(self, reason, force):
        """SIGTERM the launcher, wait up to stop_grace, then SIGKILL every tagged survivor."""
        self.out.send(wire.Stopping(reason=reason))
        code = None
        if not force:
            self.send_launcher(signal.SIGTERM)
            deadline = time.monotonic() + self.spec.stop_grace
            while code is None and time.monotonic() < deadline:
                event = self.wait_event(deadline)
                if event and event[0] == "exited" and event[1][0] == self.attempt:
                    code = event[1][1]
                elif event and event[0] == "kill":
                    break
        return self.finish(code, stopped=True, reason=reason)

    def wait_event(self, deadline):
        try:
            return self.events.get(timeout=max(0.0, min(self.spec.heartbeat, deadline - time.monotonic())))
        except queue.Empty:
            self.out.send(wire.Heartbeat(), block=False)
            return None

    def send_launcher(self, sig):
        if isinstance(self.proc, Workers):
            self.proc.send_signal(sig)
        elif self.proc and self.proc.poll() is None:
            signal_tagged(self.proc.pid, sig, self.match)

    def sample_gpus(self):
        """GPU use for the dashboard, every GPU_SAMPLE seconds while the job runs: nvidia-smi on
        its own thread, and a sample dropped rather than queued behind the job's lines."""
        while not self.ended.wait(GPU_SAMPLE):
            usage = nodefacts.query_usage()
            if usage and not self.ended.is_set():
                self.out.send(wire.GpuUsage(gpus=usage), block=False)

    def gpu_left(self):
        """This launch's processes that still hold GPU memory once the job is over (a process
        stuck in the driver survives SIGKILL): None where there are none, or no GPUs."""
        if not nodefacts.has_nvidia_gpus():
            return None
        apps = nodefacts.parse_apps(nodefacts.nvidia_smi(nodefacts.APPS_QUERY))
        ours = [app for app in apps if all((read_tags(app["pid"]) or {}).get(k) == v for k, v in self.match.items())]
        return [nodefacts.holder(app, app["uuid"], nodefacts.process_owner) for app in ours] or None

    def finish(self, code, stopped, reason):
        self.ended.set()
        if isinstance(self.proc, Workers):
            self.proc.ending()  # the SIGKILL below is ours: not a worker's failure to report
        kill_tagged(self.match, grace=0, first_signal=signal.SIGKILL)
        if code is None and self.proc is not None:
            try:
                code = self.proc.wait(timeout=KILL_WAIT)
            except subprocess.TimeoutExpired:
                code = None
        # Every line before the exit frame. The job's processes are gone, so the pipes reach EOF
        # and the log files are complete; what bounds the wait is the controller reading (a
        # stalled connection: orphan_timeout).
        stall = self.spec.orphan_timeout
        for t in self.pumps:
            join_while_moving(t, self.out, stall)  # stuck: a held pipe, or a dead connection
        if self.tailer is not None:
            self.tailer.finish(stall)
        self.out.send(wire.Exited(code=code, signal=signal_name(code), stopped=stopped, reason=reason,
                                  gpu_left=self.gpu_left()))
        if self.record is not None:
            self.next_go = self.finish_detached(code, stopped, reason)
            if self.next_go is not None:
                return 0  # the next attempt: same state directory, a journal and logs of its own
        self.out.drain(stall)
        self.cleanup_state(keep_logs=self.out.broken or self.record is not None)
        return 0

    def finish_detached(self, code, stopped, reason):
        """Record how the attempt ended here and tell the supervisor. The master node's agent
        then waits for every node's end (or loss) and decides: the next attempt (restarts left,
        every node still heard, no one stopped it for good) after its delay, or the job's end,
        recorded. Every other node waits for that word while restarts are left. Returns the Go
        of the next attempt here, or None: the job is over."""
        state = "stopped" if stopped else ("done" if code == 0 else "failed")
        more = self.attempt < self.spec.restarts and not self.for_good
        self.record.update(ended=time.time(), state="restarting" if more else state, code=code, reason=reason)
        write_record(self.dir, self.record)
        go = None
        if self.supervisor is not None:
            self.supervisor.report(self.spec.node, state, code, reason, self.attempt, self.for_good)
            self.supervisor.finished.wait()
            if not self.supervisor.over_event.is_set():
                go, why = self.restart_here()
                if go is None:
                    self.supervisor.over(why)
        elif self.link is not None:
            self.link.report(state, code, reason, self.attempt, self.for_good, keep=more)
            go = self.await_restart() if more else None
        if go is None and more:
            self.record.update(state=state)
            write_record(self.dir, self.record)
        return go

    def restart_here(self):
        """The master node, between two attempts: wait the delay (a signal ends the job instead),
        hold the next master port (a fresh one, or the one the cluster file sets), and tell every
        node to start (Restart). (the Restart, None) or (None, why the job ends here)."""
        attempt = self.attempt + 1
        deadline = time.monotonic() + self.spec.restart_delay * attempt
        while time.monotonic() < deadline:
            event = self.wait_event(deadline)
            if event and event[0] in ("stop", "kill"):
                return None, "stopped for good while it waited to restart"
        try:  # held until the launcher starts, as for the first attempt
            self.listener = listen_on(self.spec.check_port or 0)
        except OSError as e:
            return None, "master port %s not free for attempt %d (%s)" % (self.spec.check_port, attempt, e.strerror)
        port = self.listener.getsockname()[1]
        self.supervisor.restart(attempt, port)
        return wire.Restart(attempt=attempt, port=port), None

    def await_restart(self):
        """Every other node, between two attempts: the supervisor's word (bounded: a supervisor
        unheard for orphan_timeout is a stop, see PeerLink.beat). The Restart, or None."""
        while True:
            kind, arg = self.events.get()
            if kind == "restart":
                return arg
            if kind in ("over", "stop", "kill"):
                self.link.close()
                return None

    def begin_attempt(self, restart):
        """Start attempt ``restart.attempt`` here: the launch line of the first with the new
        master port, its own journal and torchrun log directory, DDP_UP_ATTEMPT its number."""
        self.attempt, self.next_go = restart.attempt, None
        self.out.journal.close()  # the attempt before's is complete (start opens this one's)
        self.log_dir = os.path.join(self.dir, per_attempt("logs", self.attempt))
        self.pumps, self.tailer, self.ended = [], None, threading.Event()
        go = self.first_go
        self.close_listener()
        self.start(wire.Go(argv=with_port(go.argv, restart.port), supervisor=go.supervisor, env=go.env))
        self.out.last_output = time.monotonic()
        self.record.update(state="running", attempt=self.attempt, ended=None, code=None, reason=None)
        write_record(self.dir, self.record)
        if self.supervisor is not None:
            self.supervisor.report(self.spec.node, "running", attempt=self.attempt)
        else:
            self.link.rejoin(self.attempt)

    def cleanup_state(self, keep_logs):
        """Remove this node's state; keep torchrun's log copy if the controller may have missed lines."""
        if self.dir is None:
            return
        shutil.rmtree(os.path.join(self.dir, "hooks"), ignore_errors=True)
        if keep_logs:
            return
        shutil.rmtree(self.dir, ignore_errors=True)
        try:
            os.rmdir(os.path.dirname(self.dir))  # the job's directory, once its last node is done here
        except OSError:
            pass


# --- detached jobs: the node's journal and record, and the supervisor on the master node ------
#
#   <state root>/<job>/node<N>/journal        every frame after Go, as the controller was sent it
#   <state root>/<job>/node<N>/record.json    what ddp-ls shows: script, ranks, state, times, code
#   <state root>/<job>/node<M>/outcome.json   the master node's: every node's end, the root cause

JOURNAL = "journal"
RECORD = "record.json"
OUTCOME = "outcome.json"
ENDED = ("done", "failed", "stopped", "lost")
RETENTION = 7 * 86400.0  # a finished detached job's record and journal are kept this long
JOIN_TIMEOUT = 10.0  # for a connection to the supervisor to prove it belongs to the job
HANG_DUMP_WAIT = 8.0  # after a detached job's ranks were asked for their stacks, before it is stopped


def with_port(argv, port):
    """The launch line with another master port: the launcher's ``--master-port=N`` (both take it
    so), which comes before the script; the script's own arguments are left as they are."""
    at = next(i for i, a in enumerate(argv) if a.startswith("--master-port="))
    return argv[:at] + ["--master-port=%d" % port] + argv[at + 1:]


def why_not_restart(states, attempt, restarts):
    """Why a detached job whose every node has ended this attempt is not started again, or None:
    it succeeded, no restart is left, someone stopped it for good (ddp-kill, a shutdown), or a node
    is lost (the supervisor cannot reach it to start it, and nothing takes its place)."""
    if all(st["state"] == "done" for st in states.values()):
        return "every node done"
    if attempt >= restarts:
        return "no restart left" if restarts else "no restarts set"
    if any(st.get("final") for st in states.values()):
        return "stopped for good"
    lost = sorted(n for n, st in states.items() if st["state"] == "lost")
    if lost:
        return "node %d lost (a detached job restarts only on nodes its supervisor still hears)" % lost[0]
    return None


class Journal:
    """Appends encoded frames to the journal file (created here, 0600, never through a link)."""

    def __init__(self, path):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        self.lock = threading.Lock()
        self.failed = False

    def append(self, data):
        if self.failed:
            return
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self.fd, view):]
        except OSError:
            self.failed = True  # a full disk: the job goes on; its journal is cut here

    def close(self):
        with self.lock:
            os.close(self.fd)
            self.failed = True  # nothing more goes here


def write_record(where, record, name=RECORD):
    """``record`` as JSON, replacing the last one in one rename (readers never see half)."""
    tmp = os.path.join(where, ".%s.%d" % (name, os.getpid()))
    try:
        os.unlink(tmp)
    except OSError:
        pass
    try:
        write_private(tmp, json.dumps(record))
        os.replace(tmp, os.path.join(where, name))
    except OSError:
        remove_quietly(tmp)


def read_record(where, name=RECORD):
    try:
        fd = os.open(os.path.join(where, name), os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            record = json.loads(f.read().decode("utf-8"))
        return record if isinstance(record, dict) else None
    except (OSError, ValueError):
        return None


def live_state(record):
    """The record's state, or "lost" for a job whose agent is gone without recording its end (a
    SIGKILL, a reboot): a pid that now belongs to another process does not carry the job's tag."""
    state = record.get("state")
    if state in ("running", "restarting"):
        tags = read_tags(record.get("pid") or 0) or {}
        if tags.get(TAG_JOB) != record.get("job"):
            return "lost"
    return state


def proof(token, nonce):
    import hashlib
    import hmac
    return hmac.new(token.encode(), nonce.encode(), hashlib.sha256).hexdigest()


def proof_ok(token, nonce, given):
    import hmac
    return isinstance(given, str) and hmac.compare_digest(proof(token, nonce), given)


class Supervisor:
    """The master node's agent, in a detached job: every other node's agent joins it (TCP, each
    connection proving it knows the job's token) and reports its state. The first node to fail,
    stop or fall silent for orphan_timeout halts every node, as the controller does for a job it
    watches. Once every node has ended the attempt, either the job is over (its outcome is
    recorded here, every node told RunOver) or, with restarts left and every node still heard,
    the master node's agent waits the delay and calls restart (every node told Restart)."""

    def __init__(self, runner, listener):
        self.runner = runner
        self.spec = runner.spec
        self.listener = listener
        self.port = listener.getsockname()[1]
        self.lock = threading.Lock()
        self.states = {}  # node -> {"state", "code", "reason", "at", "final"}, of the current attempt
        self.links = {}  # node -> (socket, its send lock)
        self.heard = {}  # node -> when it was last heard (monotonic)
        self.halted = None  # the reason every node was told to stop
        self.finished = threading.Event()  # every node has ended the current attempt
        self.quiet = {}  # node -> (its ranks' quiet seconds, when it said so)
        self.hung = None  # (why, when the stacks were asked for), once the job looks hung
        self.first_done = None  # when the first node's job ended well (the others should follow)
        self.attempt = runner.attempt
        self.attempts = []  # the ended attempts before the current one, as outcome.json lists them
        self.restart_frame = None  # the current attempt's Restart, for a node that missed it
        self.over_event = threading.Event()  # no attempt follows: the watch ends

    def start(self):
        now = time.monotonic()
        self.heard = {node: now for node in range(self.spec.nodes)}  # joining is due from Go on
        threading.Thread(target=self.accept, name="supervisor", daemon=True).start()
        threading.Thread(target=self.watch, name="supervisor-watch", daemon=True).start()

    def accept(self):
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self.serve, args=(conn,), daemon=True).start()

    def serve(self, conn):
        """One node's connection: the challenge, then its reports until it closes."""
        node = None
        try:
            conn.settimeout(JOIN_TIMEOUT)
            nonce = os.urandom(16).hex()
            conn.sendall(wire.Challenge(nonce=nonce).encode())
            stream = conn.makefile("rb")
            join = wire.read_frame(stream, wire.PEER)
            if not (isinstance(join, wire.Join) and 0 <= join.node < self.spec.nodes and join.node != self.spec.node
                    and proof_ok(self.spec.token, nonce, join.proof)):
                return  # not one of this job's agents: nothing is said to it
            node = join.node
            conn.settimeout(self.spec.orphan_timeout)
            with self.lock:
                self.links[node] = (conn, threading.Lock())
                self.heard[node] = time.monotonic()
                halted = self.halted
            if halted:
                self.send(node, wire.Halt(reason=halted))
            while True:
                frame = wire.read_frame(stream, wire.PEER)
                if frame is None:
                    return
                self.heard[node] = time.monotonic()
                if isinstance(frame, wire.NodeState) and frame.node == node:
                    if frame.attempt < self.attempt and self.restart_frame is not None:
                        self.send(node, self.restart_frame)  # it reconnected after the word went out
                    self.report(node, frame.state, frame.code, frame.reason, frame.attempt, frame.final)
                elif isinstance(frame, wire.Progress) and frame.node == node:
                    self.quiet[node] = (frame.quiet, self.heard[node])
        except (OSError, ValueError, wire.ProtocolError):
            pass  # a silent node is found lost by watch()
        finally:
            with self.lock:
                if node is not None and self.links.get(node, (None,))[0] is conn:
                    del self.links[node]
            conn.close()

    def send(self, node, frame):
        link = self.links.get(node)
        if link is None:
            return
        conn, lock = link
        try:
            with lock:
                conn.sendall(frame.encode())
        except OSError:
            pass

    def report(self, node, state, code=None, reason=None, attempt=None, final=False):
        with self.lock:
            if attempt is not None and attempt != self.attempt:
                return  # a word about another attempt (one resent on reconnecting)
            if self.states.get(node, {}).get("state") in ENDED:
                return  # a node ends once
            self.states[node] = {"state": state, "code": code, "reason": reason, "at": time.time(), "final": final}
            if state == "done" and self.first_done is None:
                self.first_done = time.monotonic()
            ended = sum(1 for st in self.states.values() if st["state"] in ENDED) == self.spec.nodes
        if state in ("failed", "stopped", "lost"):
            self.halt("node %d %s" % (node, describe_end(state, code, reason)))
        if ended:
            blocker = self.why_not_restart()
            if blocker is not None:
                self.over(blocker)
            self.finished.set()  # else the master node's agent restarts the job (Runner.restart_here)

    def why_not_restart(self):
        return why_not_restart(self.states, self.attempt, self.spec.restarts)

    def restart(self, attempt, port):
        """Attempt ``attempt`` begins: every node is told (and any that rejoins later, see serve);
        the watch starts afresh."""
        with self.lock:
            self.attempts.append(self.attempt_summary())
            self.attempt = attempt
            self.states, self.quiet, self.halted, self.hung, self.first_done = {}, {}, None, None, None
            now = time.monotonic()
            self.heard = {node: now for node in range(self.spec.nodes)}
            self.restart_frame = wire.Restart(attempt=attempt, port=port)
            self.finished.clear()
        for node in list(self.links):
            self.send(node, self.restart_frame)

    def over(self, reason):
        """No attempt follows: the outcome is recorded and every node told."""
        self.record_outcome()
        for node in list(self.links):
            self.send(node, wire.RunOver(reason=reason))
        self.over_event.set()

    def halt(self, reason):
        """Every node still running stops, the master node's too; only the first reason counts."""
        with self.lock:
            if self.halted is not None:
                return
            self.halted = reason
        for other in list(self.links):
            if self.states.get(other, {}).get("state") not in ENDED:
                self.send(other, wire.Halt(reason=reason))
        self.runner.events.put(("halt", (self.attempt, reason)))

    def peers(self):
        """The other nodes (the master node, where this runs, need not be node 0)."""
        return [n for n in range(self.spec.nodes) if n != self.spec.node]

    def running(self):
        return [n for n in range(self.spec.nodes) if self.states.get(n, {}).get("state") == "running"]

    def watch_hang(self, now):
        """No line from any rank for hang_timeout, or a node done that long while others run (as
        ddp-up's HangWatch): every rank prints its stack (into the journal, where an attach
        names the odd one out), then, HANG_DUMP_WAIT later, every node stops."""
        timeout = self.spec.hang_timeout
        if not timeout or self.halted is not None:
            return
        if self.hung is not None:
            if now - self.hung[1] > HANG_DUMP_WAIT:
                self.halt("job hung (%s)" % self.hung[0])
            return
        running = self.running()
        if not running:
            return
        quiet = min(self.quiet_of(n, now) for n in running)
        if quiet > timeout:
            self.hung = ("no output from any rank for %.0f s" % quiet, now)
        elif self.first_done is not None and now - self.first_done > timeout:
            self.hung = ("a node finished %.0f s ago, %d still running" % (now - self.first_done, len(running)), now)
        if self.hung is not None:
            for node in running:
                if node == self.spec.node:
                    self.runner.events.put(("dump", None))
                else:
                    self.send(node, wire.DumpStacks())

    def quiet_of(self, node, now):
        if node == self.spec.node:
            return now - self.runner.out.last_output
        quiet, said = self.quiet.get(node, (0.0, self.heard[node]))
        return quiet + (now - said)

    def watch(self):
        while not self.over_event.wait(self.spec.heartbeat):
            for node in list(self.links):
                self.send(node, wire.Heartbeat())
            now = time.monotonic()
            for node in self.peers():
                silent = now - self.heard[node]
                if self.states.get(node, {}).get("state") not in ENDED and silent > self.spec.orphan_timeout:
                    self.report(node, "lost", None, "no word from its agent for %.0f s" % silent)
            self.watch_hang(now)

    def attempt_summary(self):
        failures = [dict(st, node=n) for n, st in self.states.items() if st["state"] != "done"]
        first = min(failures, key=lambda f: f["at"]) if failures else None
        if self.hung is not None and self.halted and self.halted.startswith("job hung"):
            first = {"node": None, "state": "hung", "code": None, "reason": self.halted, "at": time.time()}
        return {"attempt": self.attempt, "ended": time.time(), "root_cause": first, "halted": self.halted,
                "nodes": {str(n): st for n, st in self.states.items()}}

    def record_outcome(self):
        last = self.attempt_summary()
        write_record(self.runner.dir, dict(last, job=self.spec.job, attempts=self.attempts + [last]), OUTCOME)


def describe_end(state, code, reason):
    if state == "failed":
        return "failed (exit code %s)" % code
    return "%s (%s)" % (state, reason) if reason else state


class PeerLink:
    """Every other node's agent, in a detached job: its line to the master node's Supervisor. A
    Halt stops the job here; a supervisor unheard for orphan_timeout (the master node or the
    network between them gone) stops it too, as a silent controller would. It reconnects while
    it waits: a short break in the network is not a failure."""

    def __init__(self, runner, addr, port):
        self.runner = runner
        self.spec = runner.spec
        self.addr, self.port = addr, port
        self.lock = threading.Lock()
        self.sock = None
        self.heard = time.monotonic()
        self.state = wire.NodeState(node=self.spec.node, state="running")
        self.done = threading.Event()

    def start(self):
        threading.Thread(target=self.run, name="peer-link", daemon=True).start()
        threading.Thread(target=self.beat, name="peer-beat", daemon=True).start()

    def run(self):
        while not self.done.is_set():
            try:
                self.session()
            except (OSError, ValueError, wire.ProtocolError):
                pass
            if self.done.wait(1.0):
                return

    def session(self):
        conn = socket.create_connection((self.addr, self.port), timeout=JOIN_TIMEOUT)
        try:
            conn.settimeout(self.spec.orphan_timeout)
            stream = conn.makefile("rb")
            challenge = wire.read_frame(stream, wire.PEER)
            if not isinstance(challenge, wire.Challenge):
                return
            with self.lock:
                conn.sendall(wire.Join(node=self.spec.node, proof=proof(self.spec.token, challenge.nonce)).encode()
                             + self.state.encode())
                self.sock = conn
            while True:
                frame = wire.read_frame(stream, wire.PEER)
                if frame is None:
                    return
                self.heard = time.monotonic()
                if isinstance(frame, wire.Halt):
                    self.runner.events.put(("halt", (self.runner.attempt, frame.reason)))
                elif isinstance(frame, wire.DumpStacks):
                    self.runner.events.put(("dump", None))
                elif isinstance(frame, wire.Restart) and frame.attempt > self.runner.attempt:
                    self.runner.events.put(("restart", frame))
                elif isinstance(frame, wire.RunOver):
                    self.runner.events.put(("over", frame.reason))
        finally:
            with self.lock:
                self.sock = None
            conn.close()

    def send(self, frame):
        with self.lock:
            if self.sock is None:
                return False
            try:
                self.sock.sendall(frame.encode())
                return True
            except OSError:
                return False

    def beat(self):
        while not self.done.wait(self.spec.heartbeat):
            self.send(wire.Progress(node=self.spec.node, quiet=time.monotonic() - self.runner.out.last_output))
            silent = time.monotonic() - self.heard
            if silent > self.spec.orphan_timeout:
                self.runner.events.put(("stop", "no word from the master node's supervisor for %.0f s" % silent))
                return

    def report(self, state, code, reason, attempt=0, final=False, keep=False):
        """This node's end of ``attempt``, to the supervisor (waiting a little for a connection, if
        it is between two); the link then closes, unless ``keep``: the supervisor's word on a next
        attempt is to come."""
        self.set_state(wire.NodeState(node=self.spec.node, state=state, code=code, reason=reason,
                                      attempt=attempt, final=final))
        if not keep:
            self.close()

    def rejoin(self, attempt):
        self.set_state(wire.NodeState(node=self.spec.node, state="running", attempt=attempt))

    def set_state(self, state):
        with self.lock:
            self.state = state
        deadline = time.monotonic() + 2 * self.spec.heartbeat
        while not self.send(state) and time.monotonic() < deadline:
            time.sleep(0.1)

    def close(self):
        self.done.set()


def follow(spec, writer):
    """Follow mode: the journal of one attempt of the job on this node, frame by frame, from its
    start; a later attempt's, once it has begun (a follower waits while the job waits to restart)."""
    where = job_node_dir(spec.job, spec.node)
    path = os.path.join(where or "", per_attempt(JOURNAL, spec.attempt))
    if spec.attempt and spec.follow and where:
        while not (os.path.exists(path) or writer.broken) and waiting_to_restart(read_record(where), spec.attempt):
            writer.send(wire.Heartbeat(), block=False)
            time.sleep(0.2)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        if spec.attempt and read_record(where or "") is not None:
            writer.send(wire.JournalEnd(running=False, absent=True))  # the job ended before it restarted
        else:
            writer.send(wire.Failed("no detached job %s on this node" % spec.job,
                                    "ddp-ls CLUSTER.yaml lists the jobs on the cluster's nodes"))
        writer.drain(5)
        return 3 if not spec.attempt else 0
    decoder = wire.Decoder(wire.TO_CONTROLLER)
    beat = time.monotonic()
    with os.fdopen(fd, "rb", buffering=0) as f:
        skip = backlog_to_skip(f, spec.tail) if spec.tail is not None else {}
        while not writer.broken:
            record = read_record(where) or {}
            state, current = live_state(record), record.get("attempt", 0)
            running = attempt_live(state, current, spec.attempt)
            data = f.read(1 << 20)
            if data:
                for frame in decoder.feed(data):
                    frame = skip_lines(frame, skip) if skip else frame
                    if frame is not None:
                        writer.send(frame)
                continue
            if not (spec.follow and running):
                break
            if time.monotonic() - beat > spec.heartbeat:
                writer.send(wire.Heartbeat(), block=False)
                beat = time.monotonic()
            time.sleep(0.1)
    later = current > spec.attempt or (spec.follow and state == "restarting" and current == spec.attempt)
    writer.send(wire.JournalEnd(running=running, later=later))
    writer.drain(30)
    return 0


def attempt_live(state, current, attempt):
    """Whether ``attempt``'s journal may still grow, from the record: the job runs it, or is just
    starting it (an agent creates an attempt's journal, then records that it runs it)."""
    return state in ("running", "restarting") and (current < attempt or (current == attempt and state == "running"))


def waiting_to_restart(record, attempt):
    """Whether the job may still begin ``attempt`` here (it waits to restart, or runs the one before)."""
    record = record or {}
    return live_state(record) in ("restarting", "running") and record.get("attempt", 0) < attempt


def backlog_to_skip(f, tail):
    """{(stream, rank): lines} to leave out so that ``tail`` lines of each remain of what the
    journal holds now (read from ``f``, which is then rewound)."""
    counts = {}
    decoder = wire.Decoder(wire.TO_CONTROLLER)
    while True:
        data = f.read(1 << 20)
        if not data:
            break
        for frame in decoder.feed(data):
            if type(frame) is wire.Output:
                key = (frame.stream, frame.rank)
                counts[key] = counts.get(key, 0) + frame.data.count(b"\n")
    f.seek(0)
    return {key: count - tail for key, count in counts.items() if count > tail}


def skip_lines(frame, skip):
    """``frame`` without the lines still to be skipped of its stream (None if nothing is left)."""
    if type(frame) is not wire.Output:
        return frame
    key = (frame.stream, frame.rank)
    left = skip.get(key, 0)
    if not left:
        return frame
    data, at = frame.data, 0
    while left and at < len(data):
        end = data.find(b"\n", at)
        if end < 0:
            at = len(data)  # the start of a line that ends in a later frame: skipped with it
            break
        at, left = end + 1, left - 1
    if left:
        skip[key] = left
    else:
        del skip[key]
    rest = data[at:]
    return wire.Output(frame.stream, frame.rank, rest) if rest else None


def job_node_dir(job, node):
    """The node directory of ``job`` here, or None (not a job id, or the state root not private)."""
    root = state_root()
    if not JOB_ID.fullmatch(job) or private_dir(root, create=False):
        return None
    return os.path.join(root, job, "node%d" % node)


def recorded_jobs():
    """(node directory, record) of every detached job here, with the master's outcome added."""
    root = state_root()
    if private_dir(root, create=False):
        return []
    found = []
    for job in sorted(os.listdir(root)):
        job_dir = os.path.join(root, job)
        if not JOB_ID.fullmatch(job) or private_dir(job_dir, create=False):
            continue
        for entry in sorted(os.listdir(job_dir)):
            record = read_record(os.path.join(job_dir, entry)) if entry.startswith("node") else None
            if record is not None:
                record["state"] = live_state(record)
                record["outcome"] = read_record(os.path.join(job_dir, entry), OUTCOME)
                found.append((os.path.join(job_dir, entry), record))
    return found


def list_jobs(writer):
    remove_stale_state({}, records_only=True)  # what is past its retention is not listed, and goes
    writer.send(wire.Jobs(jobs=[record for _, record in recorded_jobs()]))
    writer.drain(5)
    return 0


def expired(record, now):
    """A finished job's record past its retention (the job's own, set when it started)."""
    retention = record.get("retention", RETENTION)
    if not isinstance(retention, (int, float)):
        retention = RETENTION
    return live_state(record) != "running" and now - (record.get("ended") or record.get("started") or 0) > retention


# --- `launcher: none`: the agent starts the workers itself -----------------------------------------

LAUNCH_OPTIONS = ("nproc-per-node", "node-rank", "first-rank", "world-size", "master-addr", "master-port")
FAIL_GRACE = 5.0  # after one worker failed: SIGTERM to the others, this long, then SIGKILL


def parse_launch(argv):
    """``--name=value`` options (all of LAUNCH_OPTIONS), then SCRIPT and its arguments, untouched.
    The controller built them from the plan, in the same ddp-up that shipped this agent: a
    ValueError here is a bug, not a user's mistake."""
    opts, i = {}, 0
    while i < len(argv) and argv[i].startswith("--") and "=" in argv[i]:
        name, _, value = argv[i][2:].partition("=")
        if name not in LAUNCH_OPTIONS:
            raise ValueError("%s: unknown option --%s" % (OWN_LAUNCHER, name))
        opts[name] = value
        i += 1
    missing = [n for n in LAUNCH_OPTIONS if n not in opts]
    if missing or i >= len(argv):
        raise ValueError("%s: missing %s" % (OWN_LAUNCHER, ", ".join(missing) or "SCRIPT"))
    return opts, argv[i], argv[i + 1:]


def worker_env(opts, local_rank, base):
    """The variables ``init_process_group("env://")`` reads, as torchrun sets them."""
    nproc = int(opts["nproc-per-node"])
    env = dict(base)
    env.update({
        "RANK": str(int(opts["first-rank"]) + local_rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": opts["world-size"],
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": opts["node-rank"],
        "MASTER_ADDR": opts["master-addr"],
        "MASTER_PORT": opts["master-port"],
    })
    if nproc > 1 and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = "1"  # as torchrun does: N workers each using every core thrash
    return env


def worker_log_files(log_dir, local_rank):
    """torchrun's layout, so the Tailer relays them: <log_dir>/none/attempt_0/<local_rank>/."""
    where = os.path.join(log_dir, "none", "attempt_0", str(local_rank))
    os.makedirs(where, exist_ok=True)
    return (open(os.path.join(where, "stdout.log"), "ab"), open(os.path.join(where, "stderr.log"), "ab"))


def root_cause(opts, local_rank, pid, code):
    """torchrun's failure block, which the controller already knows how to read."""
    name = ""
    if code < 0:
        try:
            name = " (%s)" % signal.Signals(-code).name
        except ValueError:
            pass
    return ("=" * 60 + "\n%s FAILED (ddp-up launcher: none)\nRoot Cause (first observed failure):\n[0]:\n"
            "  time      : %s\n  host      : %s\n  rank      : %d (local_rank: %d)\n"
            "  exitcode  : %d (pid: %d)%s\n" + "=" * 60 + "\n") % (
                OWN_LAUNCHER, time.strftime("%Y-%m-%d_%H:%M:%S"), socket.gethostname(),
                int(opts["first-rank"]) + local_rank, local_rank, code, pid, name)


class Workers:
    """`launcher: none`: this node's workers, each ``python -u SCRIPT ARGS``, started by the agent
    itself (a launcher process would be one more interpreter per node, paid N times on a big
    cluster), and stopped together when one fails, as torchrun does. To the Runner it looks like
    the launcher process it replaces: ``send_signal``, ``poll``, ``wait`` and an exit status
    (the first failure's, or 128 + the signal that stopped them); the first failure goes out as
    torchrun's Root Cause block on the launcher's stderr."""

    def __init__(self, launch, env, match, report):
        self.opts, script, args = launch
        self.argv = [sys.executable, "-u", script] + list(args)
        self.env, self.match, self.report = env, match, report
        self.procs = {}  # Popen -> local rank
        self.exits = queue.SimpleQueue()  # (Popen, exit status), from a waiting thread per worker
        self.stopping = None  # the signal that asked them to stop (a failure is not reported then)
        self.not_started = False  # a worker could not be started: the others were stopped
        self.code = None
        self.done = threading.Event()

    def start(self, log_dir):
        for local_rank in range(int(self.opts["nproc-per-node"])):
            try:
                proc = self.start_one(log_dir, local_rank)
            except OSError as e:  # e.g. a full disk for its log files: the job fails as a launcher would
                self.report("%s: cannot start local rank %d: %s\n" % (OWN_LAUNCHER, local_rank, e))
                self.not_started = True
                self.signal_all(signal.SIGTERM)
                break
            self.procs[proc] = local_rank
            threading.Thread(target=lambda p=proc: self.exits.put((p, p.wait())), daemon=True).start()
        threading.Thread(target=self.watch, name="workers", daemon=True).start()

    def start_one(self, log_dir, local_rank):
        out, err = worker_log_files(log_dir, local_rank)
        try:
            return subprocess.Popen(self.argv, env=worker_env(self.opts, local_rank, self.env),
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True)
        finally:
            out.close()
            err.close()

    def watch(self):
        first_failure, kill_at, left = None, None, len(self.procs)
        while left:
            try:
                proc, code = self.exits.get(timeout=None if kill_at is None else max(0.0, kill_at - time.monotonic()))
            except queue.Empty:
                self.signal_all(signal.SIGKILL)  # survivors of a failure, past the grace
                kill_at = None
                continue
            left -= 1
            if code != 0 and first_failure is None and self.stopping is None:
                first_failure = code
                self.report(root_cause(self.opts, self.procs[proc], proc.pid, code))
                self.signal_all(signal.SIGTERM)
                kill_at = time.monotonic() + FAIL_GRACE
        if first_failure is not None:
            self.code = first_failure if first_failure > 0 else 128 - first_failure
        elif self.not_started:
            self.code = 1
        else:
            self.code = 128 + self.stopping if self.stopping else 0
        self.done.set()

    def signal_all(self, sig):
        for proc in self.procs:
            if proc.returncode is None:
                signal_tagged(proc.pid, sig, self.match)  # pinned and re-checked: never a recycled pid

    def send_signal(self, sig):
        if self.stopping is None:
            self.stopping = sig
        self.signal_all(sig)

    def ending(self):
        """The agent kills what is left: whatever exits now was not a failure of its own."""
        if self.stopping is None:
            self.stopping = signal.SIGKILL

    def poll(self):
        return self.code if self.done.is_set() else None

    def wait(self, timeout=None):
        if not self.done.wait(timeout):
            raise subprocess.TimeoutExpired(OWN_LAUNCHER, timeout)
        return self.code


def signal_name(code):
    if code is None or code >= 0:
        return None
    try:
        return signal.Signals(-code).name
    except ValueError:
        return "signal %d" % -code


def listen_on(port):
    """A listening socket on ``port`` (0: one the OS picks) on every address of this node."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # Inherited by the probes it accepts: one still closing when torchrun's store binds the port
    # (with SO_REUSEADDR, as c10d does) is then no obstacle. A second listener is refused as ever.
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("", port))
        s.listen(1024)
    except OSError:
        s.close()
        raise
    return s


def answer_probes(listener):
    """Accept every probe while the port is held. Unaccepted, they would fill the backlog, and the
    nodes after it would time out (128 nodes did). Each prober closes first, so the TIME_WAIT
    stays on its side and torchrun can bind this port the moment it is released."""
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return  # shut down at go
        try:
            conn.settimeout(PROBE_CLOSE_WAIT)
            conn.recv(1)  # b"": the prober has closed
        except OSError:
            pass
        finally:
            conn.close()


PROBE_CLOSE_WAIT = 5.0


# Run in the job's environment (its PYTHONPATH counts), without importing torch (seconds of CPU):
# the version from its metadata, the CUDA it was built for from torch/version.py (plain text), and
# NCCL from the pip package CUDA builds depend on.
TORCH_PROBE = r"""
import importlib.metadata as m, importlib.util as u, json, os, re
def version(name):
    try:
        return m.version(name)
    except Exception:
        return None
spec, info = u.find_spec("torch"), {}
if spec is not None:
    info["torch"] = version("torch") or "?"
    try:
        with open(os.path.join(os.path.dirname(spec.origin), "version.py")) as f:
            found = re.search(r"^cuda\b[^=\n]*=\s*'([^']+)'", f.read(), re.M)
        info["cuda"] = found.group(1) if found else None
    except (OSError, TypeError):
        info["cuda"] = None
    info["nccl"] = next(filter(None, map(version, ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11"))), None)
print(json.dumps(info))
"""


def probe_torch(env):
    """{"torch", "cuda", "nccl"} versions the job would use, or None if it has no torch."""
    try:
        out = subprocess.run([sys.executable, "-c", TORCH_PROBE], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, timeout=60).stdout
        info = json.loads(out.decode().strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
    return info if info.get("torch") else None


def job_env(extra):
    """The environment the job gets: this agent's (after `setup:`), then the plan's `env`."""
    env = dict(os.environ)
    env.update(extra or {})
    return env


def count_gpus(env):
    """GPUs the job would see: CUDA_VISIBLE_DEVICES in its environment if set, else the driver's list."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len(nodefacts.visible_ids(visible))
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def detect(spec, writer):
    """One-shot facts for planning (``gpus: auto``), before any job exists."""
    writer.send(wire.Detected(gpus=count_gpus(job_env(spec.env))))
    writer.drain(5)
    return 0


# --- sweep mode (ddp-kill, and the controller's fallback) ---------------------------------------

def sweep(spec, writer):
    match = {k: str(v) for k, v in spec.match.items() if v is not None}
    found = find_tagged(match)
    writer.send(wire.Listed(found=found))
    if spec.dry_run:
        result = {"found": found, "killed": [], "left": []}
    else:
        result = stop_agents_first(match, spec.grace)
        remove_stale_state(match, purge=spec.purge)
    writer.send(wire.Swept(killed=result["killed"], left=result["left"]))
    writer.drain(5)
    return 0


def stop_agents_first(match, grace):
    """kill_tagged, but a detached job's agents first get SIGTERM and ``grace`` to stop their own
    job and record its end (their workers are still there when they look)."""
    agents = [p["pid"] for p in find_tagged(match) if AGENT_MARK in p["cmd"]]
    stopped = [pid for pid in agents if signal_tagged(pid, signal.SIGTERM, match)]
    wait_gone(stopped, grace + KILL_WAIT)
    return kill_tagged(match, grace=grace)


def remove_stale_state(match, purge=False, records_only=False):
    """Remove the node directories (hooks, and any torchrun log copy kept for a vanished
    controller) of jobs that no longer have processes here; only in a private state root, only
    directories named as ddp-up names them, never through a link. A detached job's record and
    journal stay for its retention after its end, unless ``purge``; ``records_only``: only
    those (a launch's leftovers are a sweep's business)."""
    root = state_root()
    if private_dir(root, create=False):
        return
    job = match.get(TAG_JOB)
    jobs = [job] if job else os.listdir(root)
    for name in jobs:
        job_dir = os.path.join(root, name)
        if not JOB_ID.fullmatch(name) or private_dir(job_dir, create=False):
            continue
        for entry in os.listdir(job_dir):
            tags = parse_node_dir(entry)
            if tags is None:
                continue
            record = read_record(os.path.join(job_dir, entry))  # first: a /proc scan is the costly part
            if record is None and records_only:
                continue
            if record is not None and not (purge or expired(record, time.time())):
                continue  # a detached job's, kept for its retention
            if not find_tagged({TAG_JOB: name, **tags}):
                shutil.rmtree(os.path.join(job_dir, entry), ignore_errors=True)  # does not follow links
        try:
            os.rmdir(job_dir)  # only if empty
        except OSError:
            pass


# --- sync mode (the workdir copy before a launch) ----------------------------------------------

def sync_needs(dest, entries):
    """Indices of the entries that differ on this node: missing, another kind or link target, or
    another size, whole-second mtime (as rsync compares) or permission bits."""
    need = []
    for i, (rel, size, mtime_ns, mode, link) in enumerate(entries):
        try:
            st = os.lstat(os.path.join(dest, rel))
        except OSError:
            need.append(i)
            continue
        if link is not None:
            same = stat.S_ISLNK(st.st_mode) and os.readlink(os.path.join(dest, rel)) == link
        else:
            same = (stat.S_ISREG(st.st_mode) and st.st_size == size and st.st_mtime_ns // 10**9 == mtime_ns // 10**9
                    and stat.S_IMODE(st.st_mode) == mode)
        if not same:
            need.append(i)
    return need


def safe_relpath(rel):
    """A path inside the destination: relative, no `..`, no empty or NUL parts."""
    parts = rel.split("/")
    return bool(rel) and not rel.startswith("/") and "\0" not in rel and all(p not in ("", ".", "..") for p in parts)


SYNC_TOKEN = "%d-%s" % (os.getpid(), os.urandom(4).hex())
# Each node's sync agent leaves an empty file of this name + its token in the workdir while it
# works; a node that finds another's marker in its own workdir shares that directory (NFS).
MARKER_PREFIX = ".ddp-up-sync-"


def remove_quietly(*paths):
    for path in paths:
        if path:
            try:
                os.unlink(path)
            except OSError:
                pass


class SyncFailed(Exception):
    pass


class IdleGuard:
    """The controller's stream, read with a dead-man switch: nothing for ``limit`` seconds means
    the controller is gone without closing (a partition), so the agent drops its partial file
    and exits instead of waiting on a dead connection."""

    def __init__(self, stream, limit):
        self.stream = stream
        self.limit = limit
        self.last = time.monotonic()
        self.partial = None  # the temp file being written
        self.leftovers = []  # more files to remove on the way out (the marker)
        self.chunk = memoryview(bytearray(SYNC_CHUNK))
        threading.Thread(target=self._watch, name="idle", daemon=True).start()

    def readline(self):
        line = self.stream.readline()
        self.last = time.monotonic()
        return line

    def read_some(self, n):
        """Up to ``n`` bytes, what has arrived (a slow transfer still counts as alive), in a
        buffer reused by the next call: a fresh megabyte per pipe read costs a fifth of the copy."""
        got = self.stream.readinto1(self.chunk[:n])
        self.last = time.monotonic()
        return self.chunk[:got]

    def _watch(self):
        while time.monotonic() - self.last < self.limit:
            time.sleep(1.0)
        remove_quietly(self.partial, *self.leftovers)
        os._exit(3)


SYNC_CHUNK = 1 << 20  # the most one read of a synced file takes from the pipe

TEMP_NUMBERS = itertools.count()


def temp_beside(path, made=set()):
    """A temp name in ``path``'s directory (created if missing), for a write renamed into place.
    Unique across nodes too (workdirs on a shared filesystem get the copy from every node at once),
    and short whatever ``path``'s own name: a name at the filesystem's limit must still work.
    ``made``: the directories this agent has made sure of, each asked for once, not once a file."""
    where = os.path.dirname(path)
    if where not in made:
        os.makedirs(where, exist_ok=True)
        made.add(where)
    return os.path.join(where, ".ddp-up-%s-%d" % (SYNC_TOKEN, next(TEMP_NUMBERS)))


def link_in_parents(dest, rel):
    """The first directory of ``rel`` under ``dest`` that is a symbolic link on this node, or
    None. Sync never writes through one: a copy must not land outside the workdir."""
    path = dest
    for part in rel.split("/")[:-1]:
        path = os.path.join(path, part)
        try:
            if stat.S_ISLNK(os.lstat(path).st_mode):
                return path
        except FileNotFoundError:
            return None  # the rest is created below, as real directories
    return None


def receive_file(stream, path, size, mtime_ns, mode):
    """``size`` bytes from ``stream`` (an IdleGuard) into ``path``, atomically (a temp file, then
    rename). Plain descriptors: a source tree is mostly small files, and a file object's set-up
    costs more than their bytes."""
    tmp = temp_beside(path)
    stream.partial = tmp
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            left = size
            while left:
                data = stream.read_some(min(left, SYNC_CHUNK))
                if not data:
                    raise SyncFailed("the controller went away mid-file")
                left -= len(data)
                while data:
                    data = data[os.write(fd, data):]
            os.fchmod(fd, mode)
            os.utime(fd, ns=(mtime_ns, mtime_ns))
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        remove_quietly(tmp)
        raise
    finally:
        stream.partial = None


def place_link(path, target):
    """The link, replacing a file or link there in one rename (other nodes may be placing the same
    one on a shared filesystem); a directory in the way is reported, never removed."""
    tmp = temp_beside(path)
    os.symlink(target, tmp)
    try:
        os.replace(tmp, path)
    except OSError:
        remove_quietly(tmp)
        raise


def widen_pipe(fd):
    """A pipe of SYNC_CHUNK bytes instead of Linux's 64 KB: sshd then hands over a megabyte per
    wake-up (measured: the agent's side of a 128 MB copy, 1.05 -> 0.9 s, as fast as cat's)."""
    if not sys.platform.startswith("linux"):
        return  # F_SETPIPE_SZ's number is Linux's own
    try:
        import fcntl
        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), SYNC_CHUNK)
    except (ImportError, OSError, ValueError):
        pass  # not a pipe (a local transport may give a socket), or over the user's pipe limits


def receive(spec, writer, stream):
    """Say which entries differ (Needs), then take a File frame + bytes for each until EndOfFiles.
    Never deletes: files only the node has (outputs, checkpoints) stay."""
    widen_pipe(stream.fileno())
    dest = os.path.abspath(os.path.expanduser(spec.dest))
    entries = spec.entries
    bad = [e[0] for e in entries if not safe_relpath(e[0])]
    try:
        if bad:
            raise SyncFailed("refusing path %r: outside the destination" % bad[0])
        os.makedirs(dest, exist_ok=True)
        need = sync_needs(dest, entries)
        linked = next(filter(None, (link_in_parents(dest, entries[i][0]) for i in need)), None)
        if linked:
            return sync_failed(writer, "cannot sync into %s: %s is a symbolic link on this node, and sync never "
                                       "writes through one" % (dest, linked), None,
                               fix="remove the link there (the copy makes a real directory), or exclude that "
                                   "path from `sync:`")
        marker = os.path.join(dest, MARKER_PREFIX + SYNC_TOKEN)
        open(marker, "wb").close()
    except (OSError, SyncFailed) as e:
        return sync_failed(writer, "cannot sync into %s: %s" % (dest, getattr(e, "strerror", None) or e),
                           getattr(e, "errno", None), "a file is in the way of the workdir: remove it there, "
                                                      "or set another `workdir:`")
    writer.send(wire.Needs(dest=dest, need=need, marker=os.path.basename(marker)))
    done = {"files": 0, "bytes": 0, "links": 0, "at": dest}  # "at": the path being written
    guard = IdleGuard(stream, spec.idle_timeout)
    guard.leftovers.append(marker)
    failure = None
    try:
        take_files(guard, dest, entries, done, writer)
        for i in need:
            rel, _, _, _, link = entries[i]
            if link is not None:
                done["at"] = os.path.join(dest, rel)
                place_link(done["at"], link)
                done["links"] += 1
    except (OSError, SyncFailed, ValueError, IndexError, wire.ProtocolError) as e:
        failure = e
    finally:
        remove_quietly(marker)  # before the answer: whoever reads it finds the workdir as it stays
    if failure is not None:
        return sync_failed(writer, "cannot write %s: %s" % (done["at"], getattr(failure, "strerror", None) or failure),
                           getattr(failure, "errno", None))
    writer.send(wire.Copied(files=done["files"], bytes=done["bytes"], links=done["links"]))
    writer.drain(5)
    return 0


def take_files(stream, dest, entries, done, writer):
    """Each File frame and its bytes, until EndOfFiles. AskShared asks which of the other nodes'
    markers this workdir holds too (a shared filesystem), answered by Shared."""
    while True:
        frame = wire.read_frame(stream)
        if frame is None:
            raise SyncFailed("the controller went away")
        if isinstance(frame, wire.EndOfFiles):
            return
        if isinstance(frame, wire.AskShared):
            names = [n for n in frame.markers if n.startswith(MARKER_PREFIX) and safe_relpath(n) and "/" not in n]
            writer.send(wire.Shared(sees=[n for n in names if os.path.exists(os.path.join(dest, n))]))
            continue
        if not isinstance(frame, wire.File):
            raise SyncFailed("protocol error: %s in sync mode" % type(frame).__name__)
        rel, _, _, mode, _ = entries[frame.index]
        done["at"] = os.path.join(dest, rel)
        receive_file(stream, done["at"], frame.size, frame.mtime_ns, mode)
        done["files"] += 1
        done["bytes"] += frame.size


def sync_failed(writer, what, err=None, in_the_way=None, fix=None):
    """Report a failed copy, with ``fix`` or the fix its errno points at (``in_the_way`` for a
    file where a directory must be, or the other way round)."""
    if fix is None and err in (errno.EISDIR, errno.ENOTDIR, errno.EEXIST, errno.ENOTEMPTY):
        fix = in_the_way or ("a file in the copy has the name of a directory on the node (or the other way "
                             "round): remove it there")
    elif fix is None:
        fix = "check the node's disk space and that `workdir:` is writable"
    writer.send(wire.Failed(what=what, fix=fix))
    writer.drain(5)
    return 3


def main():
    writer = Writer(sys.stdout.buffer)
    try:
        spec = wire.read_frame(sys.stdin.buffer)
        if spec is None:  # the controller went away before saying what to do (a failed sync scan)
            os._exit(0)
        if not isinstance(spec, wire.SPECS):
            raise wire.ProtocolError("expected a spec frame first, got %s" % type(spec).__name__)
    except wire.ProtocolError as e:
        writer.send(wire.Failed(what="protocol error from the controller: %s" % e,
                                fix="use the same ddp-up version on both ends"))
        writer.drain(5)
        os._exit(3)
    if isinstance(spec, wire.SweepSpec):
        code = sweep(spec, writer)
    elif isinstance(spec, wire.DetectSpec):
        code = detect(spec, writer)
    elif isinstance(spec, wire.SyncSpec):
        code = receive(spec, writer, sys.stdin.buffer)
    elif isinstance(spec, wire.FollowSpec):
        code = follow(spec, writer)
    elif isinstance(spec, wire.ListSpec):
        code = list_jobs(writer)
    else:
        code = Runner(spec, writer).run()
    sys.stdout.flush()
    os._exit(code)  # daemon threads may be blocked on a dead pipe; do not wait for them


if __name__ == "__main__":
    main()
