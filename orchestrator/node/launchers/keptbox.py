"""The host's side of a kept warm container (boxkeep.py, the container's first process).

A job in a container under docker or podman imports torch in the image. Kept from one attempt to
the next (a run that restarts) and from one `launch()` to the next (a Python session), the
container that did it forks each attempt's launcher, so that a restart imports nothing again,
as on the host. Its keeper (node/attempt/keep.py) starts and holds it (HeldBox); each attempt's agent
asks it for the attempt's launcher (BoxWarm, then a BoxLauncher, which the agent waits on and
signals as its launcher process). Where it cannot (not ready in time, an import touched CUDA,
gone), the attempt runs in a container of its own, as without it.

Only for docker and podman: their container has a PID namespace of its own, whose end (its first
process's) kills everything in it, so nothing the kept container forked can outlive it.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time

from ..local.procs import TAGS, TAG_KEEP, job_env
from ..local.state import open_regular, private_dir, state_root
from .container import (Box, CODE_DIR, COMMAND_WAIT, DAEMON_RUNTIMES, ENV_FILE, gpu_ids, inner_env, write_env,
                        write_package)
from .keptwarm import KeptWarm, kept_dir
from .warm import APPEAR_WAIT, Forker, LINE_MAX, READY_WAIT, WarmChild

START_WAIT = 120.0  # seconds its container may take to start and listen (a loaded node, a big image's start)


def keeps_box(container):
    """Whether a job in ``container`` (RunSpec.container) keeps its warm container across launches."""
    return bool(container) and container.get("runtime") in DAEMON_RUNTIMES


class HeldBox(Forker):
    """A kept container, as its holder (a keeper, or a detached job's agent) has it: started at
    once, ready (or not) later, held by one connection; the holder's interpreter, as a warm.Warm
    is on the host: ``answered``, ``hello``, ``proc``, ``reap``. ``env``: the holder's (its
    variables named in ``own``, and those it sets over the agent's own, go in); ``tags``: the
    container's name and labels, and its processes' (container.container_name)."""

    def __init__(self, spec, tags, env, where, own):
        self.hello, self.said, self.conn, self.report = None, threading.Event(), None, None
        workdir = os.path.expanduser(spec.workdir or "~")  # the attempts' launchers start there
        self.box = Box(spec.container, tags, workdir, binds=(state_root(),), gpus=gpu_ids(env, spec.nproc))
        env_file = os.path.join(where, ENV_FILE)
        write_env(env_file, inner_env(env, job_env(None), own, self.box.gpus))  # private; never a command line
        write_package(env_file + CODE_DIR, spec.box_code or {})
        main = self.box.box_main("launchers.boxkeep", env_file, [where, ",".join(spec.preload or ()), str(spec.nproc or 1)])
        self.log = os.path.join(where, "box.log")
        # the client carries the container's tags, no attempt's: an attempt's end kills what carries its own
        client_env = dict({k: v for k, v in os.environ.items() if k not in TAGS}, **tags)
        with open(self.log, "ab") as log:  # the runtime's own errors (a container that cannot start)
            self.proc = subprocess.Popen(self.box.run_argv(main, env_file), env=client_env, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=log, start_new_session=True)
        threading.Thread(target=self.hold, args=(os.path.join(where, "sock"),), name="kept-box", daemon=True).start()

    def hold(self, path, every=0.05):
        """Connect once the container listens, ask to hold it, and take its hello."""
        deadline = time.monotonic() + START_WAIT
        while self.conn is None and self.proc.poll() is None and time.monotonic() < deadline:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                conn.connect(path)
                conn.sendall(b'\n{"hold": 1}\n')
                self.conn = conn
            except OSError:
                conn.close()
                time.sleep(every)  # its container is starting: nothing to wait on but the socket's appearance
        try:
            line = self.conn.makefile("rb").readline(LINE_MAX) if self.conn is not None else b""
            self.hello = json.loads(line) if line else None
        except (OSError, ValueError):
            self.hello = None
        if not isinstance(self.hello, dict):
            self.hello = {"cold": "the warm container did not start (%s)" % self.last_error()}
        self.said.set()

    def last_error(self):
        """The runtime's last line in the log (why its container did not start)."""
        fd, lines = open_regular(self.log), []
        if fd is not None:
            with os.fdopen(fd, "rb") as f:
                f.seek(max(0, os.fstat(fd).st_size - 4096))
                lines = [line.strip() for line in f.read(4096).decode("utf-8", "replace").splitlines() if line.strip()]
        return lines[-1][:300] if lines else "no answer in %.0f s" % START_WAIT

    def answered(self, timeout):
        return self.said.wait(timeout)

    def give_up(self):
        """A kept container is never given up on by its keeper: each launch decides for itself."""

    def reap(self, timeout=None):
        """The container removed (its first process killed, and with it all it forked), its client waited for."""
        if self.conn is not None:
            self.conn.close()  # it ends by itself too, once it sees this
        self.box.remove()
        try:
            self.proc.wait(COMMAND_WAIT if timeout is None else timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class BoxWarm(KeptWarm):
    """An attempt's agent's side of a kept container: its hello (KeptWarm's), then ``launch``."""

    @property
    def appear(self):
        """Seconds its socket may take to appear: while its keeper's directory is there, the
        container's start (READY_WAIT); without it (not made yet, or its container could not start
        and its keeper ended), a keeper's own start (APPEAR_WAIT)."""
        return READY_WAIT if os.path.isdir(os.path.dirname(self.path)) else APPEAR_WAIT

    instead = "the attempt runs in a container of its own"

    def launch(self, argv, env, fds, passed):
        """A BoxLauncher running the launcher ``argv`` with ``env`` over the container's own and the
        stdio ``fds``; None where it cannot (the attempt then runs in a container of its own)."""
        if not self.usable():
            return None
        request = json.dumps({"launch": list(argv), "env": dict(env), "passed": passed}).encode()
        try:
            conn = self.connect(b"\n" + request + b"\n", fds)
        except OSError:
            return None
        answers = conn.makefile("rb")
        try:
            conn.settimeout(30.0)
            answer = json.loads(answers.readline(LINE_MAX))
            conn.settimeout(None)
        except (OSError, ValueError):
            answer = {}
        if not isinstance(answer, dict) or "started" not in answer:
            conn.close()
            if isinstance(answer, dict) and answer.get("cold") and self.report:
                self.report("ddp-up: warm start: %s; %s\n" % (answer["cold"], self.instead))
            return None
        return BoxLauncher(conn, answers)


class HeldHere(BoxWarm):
    """A detached job's kept container (its agent runs every attempt, and holds it): the job's
    tags, less the attempt's, on it and in it, so ddp-kill and the job's end find it; a
    BoxWarm for each attempt's launcher."""

    def __init__(self, spec, tags, env, own, report=None):
        name = "%s-n%s" % (spec.job, spec.node)
        super().__init__(name, report)
        self.where, tags = kept_dir(name), dict(tags, **{TAG_KEEP: name})
        if os.path.lexists(self.where):  # this agent's earlier one ended (WarmLine.take): what is left of it goes
            Box(spec.container, tags, "/").remove()
            shutil.rmtree(self.where, ignore_errors=True)
        why = private_dir(self.where)
        if why:
            raise OSError(why)
        self.held = HeldBox(spec, tags, env, self.where, own)
        self.proc = self.held.proc

    def reap(self, timeout=None):
        self.held.reap(timeout)
        shutil.rmtree(self.where, ignore_errors=True)


class BoxLauncher(WarmChild):
    """An attempt's launcher in the kept container, as the agent waits on it (like a Popen) and
    signals it (through the container: its pid is the container's, never signalled from here)."""

    def __init__(self, conn, answers):
        super().__init__(None)
        self.conn, self.lock = conn, threading.Lock()
        threading.Thread(target=self.watch, args=(answers,), name="box-launcher", daemon=True).start()

    def watch(self, answers):
        try:
            line = answers.readline(LINE_MAX)
            code = int(json.loads(line)["code"]) if line else None
        except (OSError, ValueError, KeyError, TypeError):
            code = None
        self.end(-9 if code is None else code)  # the container ended under it: everything in it was killed
        self.conn.close()

    def send_signal(self, sig):
        with self.lock:
            try:
                self.conn.sendall(json.dumps({"signal": signal.Signals(sig).name}).encode() + b"\n")
            except OSError:
                pass  # it has ended: its status is on its way

