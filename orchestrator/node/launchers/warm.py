"""Warm start: an interpreter on the node that imported torch (and the cluster file's `preload:`)
before it was asked, and forks each rank from it, so a rank begins without importing them again.

The warm interpreter is the job's own Python, started by the agent with the job's environment
once the node's preflight passed. It runs userpython/warmparent.py (stdlib only), from files the agent
writes (local/ourcode.py): the imports, each followed by a check that nothing made CUDA unusable
in a forked child (warmparent.cuda_touched), then it
answers, one JSON object a line, on two sockets:

  the agent's (a socketpair)                     `launcher: none`: Workers asks for each rank
    interpreter -> agent   {"ready": PID, "seconds": S, "notices": [...]}  or  {"cold": REASON}
    agent -> interpreter   {"start": LOCAL_RANK, "argv": [SCRIPT, ARGS...], "env": {...}, "cwd": DIR,
                            "stdout": PATH, "stderr": PATH}
    interpreter -> agent   {"started": LOCAL_RANK, "pid": PID}, later {"ended": PID, "code": CODE}
  a listening one, in the job's private directory   torchrun: each worker is a stand-in (standin.py)
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
import struct
import subprocess
import threading
import time

from ..local.ourcode import written
from ..local.procs import TORCHRUN, signal_name
from ..protocol import policy
from ..userpython.proctitle import ROOM, ROOM_VAR
from ..userpython.standin import CODE_VAR, PASS_VAR, SOCKET_VAR
from ..userpython.warmparent import LOADER

PRELOAD = ("torch", "torch.distributed")  # what every warm interpreter imports, before the cluster file's
READY_WAIT = 60.0  # seconds a node's ranks wait after the Go for its imports; then they start cold
APPEAR_WAIT = 5.0  # seconds a kept interpreter's socket may take to appear (its keeper's start), once asked for
LINE_MAX = 1 << 20  # bytes of one line from the interpreter (it is the job's Python: bounded)

class WarmChild:
    """A rank forked by the warm interpreter, as Workers waits on it and signals it: like a Popen."""

    def __init__(self, pid):
        self.pid = pid
        self.returncode = None
        self.ended = threading.Event()
        self.lost = None  # why its exit status is unknown (its interpreter died first), if it is

    def end(self, code):
        self.returncode = code
        self.ended.set()

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        if not self.ended.wait(timeout):
            raise subprocess.TimeoutExpired("process %s" % self.pid, timeout)
        return self.returncode

    def send_signal(self, sig):
        """Where the pid is this process's to signal: in the container that forked it (boxwarm.py);
        the agent on the host signals by tags (procs.signal_tagged)."""
        try:
            os.kill(self.pid, sig)
        except OSError:
            pass  # it has ended: its status is on its way


IMPORTS_SHOWN = 8192  # bytes of what the warm interpreter's imports printed, shown once


class Forker:
    """What both kinds of warm interpreter share: how long a fork waits for the imports, and what
    a user is told where it cannot fork."""

    instead = "the ranks start cold"  # what happens where it cannot (a kept container: keptbox.BoxWarm)
    patience = READY_WAIT  # seconds a fork waits; 0 once the node waited its READY_WAIT after the Go (run.await_warm)
    late = False  # it was given up on: this attempt starts cold
    died = None  # how it died while ranks it forked ran (policy.warm_died_words), if it did
    importing = None  # the preload it said it was importing, until ready (a Warm's)

    def usable(self):
        """Whether ranks can be forked now; if the imports are still not done, it is given up on,
        once, with one notice, and the ranks start cold."""
        if self.ready(self.patience):
            return True
        if not self.late:
            self.late, importing = True, self.hello is None
            self.give_up()
            if importing and self.report:
                still = " (still importing %s)" % self.importing if self.importing else ""
                self.report("ddp-up: warm start: the imports took too long%s; %s\n" % (still, self.instead))
        return False

    def why_cold(self):
        """The one notice for a user whose ranks start cold, or None."""
        if self.hello is None:
            return "the warm interpreter did not get ready; %s" % self.instead
        return "%s; %s" % (self.hello["cold"], self.instead) if "cold" in self.hello else None


class Warm(Forker):
    """The agent's side of one warm interpreter: started at once, ready (or not) later. ``fork``
    gives a WarmChild, or None where the ranks start cold (not ready, gone, or it said why)."""

    def __init__(self, python, env, cwd, log, preload=(), base=PRELOAD, listen="", keep=False, report=None, nproc=1,
                 lasting=False):
        self.lasting = lasting  # it forks every attempt of a detached job (run.WarmLine): an attempt does not close it
        names = ["?" + n for n in base] + [n for n in preload if n not in base]  # ?: quiet if missing (warmparent.prepare)
        env = dict(env)
        if nproc > 1:  # read once, at torch's import: as torchrun and workers.worker_env set it for N ranks
            env.setdefault("OMP_NUM_THREADS", "1")
        env.pop(ROOM_VAR, None)
        env[ROOM_VAR] = "." * ROOM  # last: see proctitle.rename
        self.socket = listen  # where torchrun's stand-ins ask (standin.SOCKET_VAR)
        self.code = written(os.path.dirname(os.path.abspath(log)))  # where it and the stand-ins import from
        self.sock, theirs = socket.socketpair()
        self.log = log
        with open(log, "ab") as err:  # its own errors (a crash while importing): the ranks' go to their logs
            self.proc = subprocess.Popen([python, "-u", "-c", LOADER, self.code, str(theirs.fileno()), ",".join(names), str(os.getpid()),
                                          listen, "keep" if keep else ""],
                                         env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=err, stderr=err,
                                         pass_fds=(theirs.fileno(),), start_new_session=True)
        theirs.close()
        self.lock = threading.Lock()
        self.hello = None  # the interpreter's first answer: {"ready": ...} or {"cold": ...}
        self.said = threading.Event()
        self.children = {}  # pid -> WarmChild
        self.heard_all = False  # its socket reached its end: every line it said is read
        self.started = {}  # local rank -> pid, as the interpreter reports them
        self.forked = threading.Condition(self.lock)
        self.buffer = b""
        self.report = report  # report(text): its notices, once, on the job's stderr
        threading.Thread(target=self.read, name="warm", daemon=True).start()

    def read(self):
        why = None
        try:
            while True:
                line = self.line()
                if line is None:
                    break
                self.take(json.loads(line))
        except (OSError, ValueError) as e:
            why = "it said what is not its protocol (%s)" % e
        if len(self.buffer) > LINE_MAX:
            why = "it said more than %d bytes in one line" % LINE_MAX
        if why or self.hello is None:  # gone before it said ready or cold: why, at once, and named
            self.proc.kill()
        self.ended(why)

    def show_imports_output(self):
        """What the imports printed (a preload's warnings, its banner), once, on the job's stderr:
        a cold start shows it in every rank's output; warm, it went to the interpreter's log."""
        if self.report is None:
            return
        try:  # its own log, in this attempt's private state folder (not one others can write)
            fd = os.open(self.log, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return
        try:
            said = os.read(fd, IMPORTS_SHOWN + 1)
        except OSError:
            return
        finally:
            os.close(fd)
        if said.strip():
            more = " (first %d bytes; the rest in %s)" % (IMPORTS_SHOWN, self.log) if len(said) > IMPORTS_SHOWN else ""
            text = said[:IMPORTS_SHOWN].decode("utf-8", "replace").rstrip("\n")
            self.report("ddp-up: warm start: the imports printed%s:\n%s\n" % (more, text))

    def ended(self, why):
        """The interpreter is gone (or was given up on): its end is told as it was, at once, and a
        child it never reported ends unknown (its exit status went with the interpreter)."""
        status = self.status()
        if self.hello is None and not self.late:
            importing = " importing %s" % self.importing if self.importing else ""
            self.take({"cold": why or "the warm interpreter %s%s" % (status, importing)})
        self.said.set()
        with self.lock:
            self.heard_all = True  # a fork still waiting has its answer, if any, by now
            running = [child for child in self.children.values() if child.returncode is None]
            for child in running:
                child.lost = "its warm interpreter %s, and its exit status with it" % status
                threading.Thread(target=watch_orphan, args=(child,), daemon=True).start()
            self.forked.notify_all()
        if running:
            self.died = policy.warm_died_words(self.proc.pid, status)
        if running and self.report:
            self.report("ddp-up: warm start: the warm interpreter (pid %d) %s while %d process(es) it forked ran: "
                        "their exit statuses are lost\n" % (self.proc.pid, status, len(running)))

    def status(self):
        """How the interpreter ended, in words (it is waited for a moment: it has closed its socket)."""
        try:
            code = self.proc.wait(2.0)
        except subprocess.TimeoutExpired:
            return "stopped answering"
        return "was killed by %s" % signal_name(code) if code < 0 else "exited with status %d" % code

    def line(self):
        while b"\n" not in self.buffer:
            data = self.sock.recv(1 << 16)
            if not data or len(self.buffer) > LINE_MAX:
                return None
            self.buffer += data
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line

    def take(self, message):
        if "importing" in message:
            self.importing = str(message["importing"])[:200]
        elif "ready" in message or "cold" in message:
            self.hello = message
            self.show_imports_output()
            for notice in ([self.why_cold()] if "cold" in message else []) + list(message.get("notices") or ()):
                self.report and self.report("ddp-up: warm start: %s\n" % notice)
            self.said.set()  # after the notices: one who waits for the answer and then execs loses none (boxwarm)
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
        elif "refused" in message:  # it will fork nothing more (beforefork.Seen.refusal): said once, then the
            with self.lock:  # fork that waits for it starts cold (its notice before the rank's first line)
                self.hello = {"cold": str(message.get("why"))}
            self.report and self.report("ddp-up: warm start: %s\n" % self.why_cold())
            with self.lock:
                self.started[message["refused"]] = None
                self.forked.notify_all()

    def ready(self, timeout=READY_WAIT):
        """Whether ranks can be forked: the imports done, CUDA untouched."""
        return self.answered(timeout) and bool(self.hello and "ready" in self.hello)

    def answered(self, timeout):
        """Whether it said ready or cold (or ended) within ``timeout`` seconds."""
        return self.said.wait(timeout)

    def give_up(self):
        """It took too long: this attempt starts cold (its end, this kill, is no news)."""
        self.late = True
        self.proc.kill()

    def reap(self, timeout=None):
        """Killed if still there, and waited for (``timeout`` seconds at most; None: however long) by
        its parent, so that it is never left a zombie to a first process that does not reap."""
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass  # stuck in the kernel: init has it once its parent is gone

    def fork(self, local_rank, argv, env, cwd, stdout=None, stderr=None, timeout=30.0, fds=None):
        """A WarmChild running ``argv`` (SCRIPT ARGS) as local rank ``local_rank``; None if the
        interpreter cannot fork it (the caller starts that rank cold)."""
        if not self.usable():  # ready already, but for a detached restart's, or after a long import
            return None
        request = {"start": local_rank, "argv": list(argv), "env": dict(env), "cwd": cwd, "stdout": stdout,
                   "stderr": stderr, **({"fds": True} if fds else {}),  # fds: its stdin, stdout, stderr, sent along
                   **store_to_await(local_rank, argv)}
        deadline = time.monotonic() + timeout
        with self.lock:
            try:
                line = json.dumps(request).encode() + b"\n"
                sent = self.sock.sendmsg([line[:1]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]) \
                    if fds else 0
                self.sock.sendall(line[sent:])
            except OSError:
                return None
            # until its answer, or every line it said was read: an interpreter that refused the fork and
            # ended (a module changed on disk) may be gone before its word is read
            while local_rank not in self.started and not self.heard_all and time.monotonic() < deadline:
                self.forked.wait(0.5)
            return self.started.pop(local_rank, None)

    def close(self):
        """No more forks: the interpreter exits once its children have (at once without any). A
        lasting one forks the next attempt's ranks: it ends with its agent (warmparent.bound_to_agent)."""
        if self.lasting:
            return
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def fork_torchrun(warm, launcher, env, passed, fds):
    """torchrun forked from ``warm`` (a Warm or KeptWarm) with the stdio ``fds``: its command line is
    PYTHON -u -m torch.distributed.run ARGS, and the interpreter is the Python and -u alike, so the
    child runs -m ... ARGS. Its workers' stand-ins (userpython/standin.py) ask ``warm`` for their ranks
    and pass the signals ``passed`` on to them. A WarmChild, or None where it cannot fork: not
    usable (it said so, once), or its folder gone meanwhile (a kept interpreter that ended as the
    node was cut off): the ranks then start cold, and a folder that vanished is no rank's failure."""
    if not warm.usable():
        return None
    try:
        code = warm.code
    except OSError as e:
        if warm.report:
            warm.report("ddp-up: warm start: the warm interpreter's folder is gone (%s); %s\n"
                        % (e.strerror or e, warm.instead))
        return None
    env = dict(env, **{SOCKET_VAR: warm.socket, PASS_VAR: passed, CODE_VAR: code})
    return warm.fork(None, launcher[2:], env, os.getcwd(), fds=fds)


def store_to_await(local_rank, argv):
    """{"after": [address, port]} for a fork of torchrun (``local_rank`` None; ``argv``: -m
    torch.distributed.run ARGS, as the plan wrote them, ``--name=value`` first) on a node other
    than the master: the master's store, which the forked torchrun waits for before it starts
    (inchild.await_store); {} for anything else."""
    if local_rank is not None or list(argv[:2]) != ["-m", TORCHRUN]:
        return {}
    opts = {}
    for word in argv[2:]:
        if not (word.startswith("--") and "=" in word):
            break
        name, _, value = word[2:].partition("=")
        opts[name] = value
    if opts.get("node-rank", "0") == "0" or not opts.get("master-addr") or not opts.get("master-port", "").isdigit():
        return {}
    return {"after": [opts["master-addr"], int(opts["master-port"])]}


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


def attempt_files(state_dir, attempt):
    """(its socket, its log) of attempt ``attempt``'s warm interpreter, in the node's state directory
    (bound at the same path into a container)."""
    where = os.path.join(state_dir, "warm.%d" % attempt)
    return where + ".sock", where + ".log"


def receive_request(conn, uid, timeout=10.0, most=4 << 20):
    """(the request, the descriptors its first byte carried) on a connection to a kept interpreter's
    socket (as KeptWarm.connect sends it), from one of ``uid``'s processes only, within ``timeout``
    seconds; OSError or ValueError otherwise (the descriptors then closed)."""
    conn.settimeout(timeout)
    fds = array.array("i")
    try:
        peer = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
        _, extra, _, _ = conn.recvmsg(1, socket.CMSG_SPACE(3 * fds.itemsize))
        for level, kind, data in extra:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
        line = b""
        while not line.endswith(b"\n") and len(line) < most:
            chunk = conn.recv(1 << 16)
            if not chunk:
                break
            line += chunk
        if peer != uid:
            raise ValueError("not this user's")
        request = json.loads(line)
        if not isinstance(request, dict):
            raise ValueError("not a request")
    except (OSError, ValueError):
        for fd in fds:
            os.close(fd)
        raise
    conn.settimeout(None)
    return request, list(fds)
