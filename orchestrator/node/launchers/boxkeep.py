"""A warm container kept from one launch to the next: its first process, in the image.

An attempt's own container (boxwarm.py) imports torch once and is gone with the attempt, so a
restart, or a Python session's next `launch()`, would import it again. This container outlives
them: node/attempt/keep.py starts it for a run that restarts, or for a Python session, and holds it.
Each attempt's agent then asks it, rather than the runtime, to start its launcher: torchrun
(or ddp-up's own, for `launcher: none`) is forked from the one interpreter here, as boxwarm
forks it, and the attempt's ranks with it.

    python -S -c BOX_MAIN%boxkeep PACKAGE DIR PRELOAD NPROC

DIR is the kept interpreter's private directory (warm.kept_dir), inside the node's state root,
which is bound into the container at the same path (the attempts' logs and hooks are there too).
The warm interpreter (warm.Warm, userpython/warmparent.py) listens on DIR/warm.sock for torchrun's
stand-ins; this process on DIR/sock, one JSON object a line, for this user's processes only:

  keeper -> box   {"hold": 1}      box -> keeper   the interpreter's hello, once it answered;
                                   the container ends when this connection does (its keeper's
                                   end, or its kill: the kernel closes it)
  agent -> box    {"hello": 1}     box -> agent    the same hello (warm.KeptWarm asks so)
  agent -> box    its launcher's stdin, stdout, stderr (SCM_RIGHTS), then
                  {"launch": ARGV, "env": {...}, "passed": "SIGTERM,..."}
                                   box -> agent    {"started": PID} (a pid of this container's),
                                                   or {"cold": WHY}: nothing started
  agent -> box    {"signal": "SIGTERM"}: passed on to the launcher
                                   box -> agent    {"code": CODE}, once the launcher ended

ENV is what the attempt sets over the container's own environment (container.inner_env), as an
attempt's env file is. If the agent's connection ends first (the agent killed), every process of
its attempt here is killed. This process is the container's PID 1: it reaps whatever is left to
it, and when it exits the kernel ends everything else in the container.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading

from ..local.procs import TAGS, TAG_KEEP, kill_tagged
from .boxwarm import start_in
from .warm import READY_WAIT, Warm, receive_request


def main(argv):
    where, preload, nproc = argv[0], [n for n in argv[1].split(",") if n], int(argv[2])
    ended = threading.Event()
    for sig in (signal.SIGUSR1, signal.SIGUSR2):  # as boxwarm: the ranks inherit it; sent to them straight
        signal.signal(sig, signal.SIG_IGN)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # the runtime's stop: as PID 1, only if handled
        signal.signal(sig, lambda *_: ended.set())
    base = {k: v for k, v in os.environ.items() if k != TAG_KEEP}  # what each attempt's environment is set over
    # its notices go out in its hello, which each attempt's agent reports on the job's stderr
    warm = Warm(sys.executable, dict(os.environ), os.getcwd(), os.path.join(where, "warm.log"), preload,
                listen=os.path.join(where, "warm.sock"), nproc=nproc, lasting=True)
    listener = listen(where, "sock")
    server = Server(warm, base, ended)
    while not ended.is_set() and not (warm.proc.poll() is not None and "ready" in (warm.hello or {})):
        server.reap_orphans()  # (an interpreter that died after its imports ends the container: its keeper makes another)
        try:
            conn = listener.accept()[0]
        except socket.timeout:
            continue
        threading.Thread(target=server.answer, args=(conn,), daemon=True).start()
    warm.reap(5.0)
    return 0


def listen(where, name):
    """The listening socket ``where``/``name``, bound from inside ``where`` (a full path may be
    longer than a socket's), accepting with a timeout so the loop sees a stop."""
    here, listener = os.getcwd(), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    os.chdir(where)
    try:
        listener.bind(name)
    finally:
        os.chdir(here)
    listener.listen(16)
    listener.settimeout(0.5)
    return listener


class Server:
    """The kept container's answers: its holder's, the hellos, and each attempt's launcher."""

    def __init__(self, warm, base, ended):
        self.warm, self.base, self.ended = warm, base, ended
        self.lock = threading.Lock()  # one attempt's launcher at a time: an attempt's agent asks once
        self.waited = set()  # pids of children whose own owner waits for them (a rank started cold)

    def answer(self, conn):
        try:
            request, fds = receive_request(conn, os.getuid())
        except (OSError, ValueError):
            conn.close()
            return
        try:
            if request.get("hold"):
                self.hold(conn)
            elif request.get("hello"):
                send(conn, self.hello())
            elif "launch" in request and len(fds) == 3:
                self.attempt(conn, request, fds)
        finally:
            for fd in fds:
                os.close(fd)
            conn.close()

    def hello(self):
        self.warm.answered(READY_WAIT)
        return self.warm.hello if self.warm.hello is not None else {"cold": "the warm interpreter did not get ready"}

    def hold(self, conn):
        """The holder's connection: the hello, then the container's life, until it ends."""
        send(conn, self.hello())
        conn.settimeout(None)
        while conn.recv(1 << 12):
            pass
        self.ended.set()

    def attempt(self, conn, request, fds):
        """An attempt's launcher, started here; its end told, or it is killed with what it
        started if the agent's connection ends first."""
        env = dict(self.base, **{str(k): str(v) for k, v in dict(request["env"]).items()})
        match = {k: env[k] for k in TAGS if k in env}
        report = os.fdopen(os.dup(fds[2]), "w", errors="replace")
        try:
            with self.lock:
                if not self.warm.usable():
                    send(conn, {"cold": (self.warm.hello or {}).get("cold") or "the warm interpreter did not get ready"})
                    return
                child = start_in(self.warm, list(request["launch"]), env, request.get("passed", ""), fds,
                                 lambda text: (report.write(text), report.flush()))
            if child is None:
                send(conn, {"cold": "the warm interpreter did not fork the launcher"})
                return
            self.waited.update(p.pid for p in getattr(child, "procs", ()) if isinstance(p, subprocess.Popen))
            send(conn, {"started": getattr(child, "pid", None)})
            threading.Thread(target=pass_on, args=(conn, child, match), daemon=True).start()
            send(conn, {"code": child.wait()})
        finally:
            report.close()

    def reap_orphans(self):
        """PID 1's duty: a process whose parent died (a stand-in whose torchrun was killed) is
        this one's child, and would stay a zombie. The warm interpreter and a cold rank are
        reaped by those who wait for them."""
        while True:
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return
            if info is None:
                return
            if info.si_pid == self.warm.proc.pid:
                self.warm.proc.poll()
            elif info.si_pid not in self.waited:
                os.waitpid(info.si_pid, 0)
            else:
                return  # its waiting thread has it now


def pass_on(conn, child, match):
    """The agent's signals, on to the launcher; the agent gone: its attempt killed here."""
    reader = conn.makefile("rb")
    try:
        for line in reader:
            name = json.loads(line).get("signal", "")
            if name in signal.Signals.__members__:
                child.send_signal(signal.Signals[name])
    except (OSError, ValueError, AttributeError):
        pass
    if child.poll() is None:
        kill_tagged(match, grace=0, first_signal=signal.SIGKILL)


def send(conn, obj):
    try:
        conn.sendall(json.dumps(obj).encode() + b"\n")
    except OSError:
        pass
