"""Keep mode's interpreter as a launch's agent uses it: a warm interpreter kept ready for every
launch of one Python session (attempt/keep.py keeps it), asked on its socket for each rank.
"""

import array
import json
import os
import socket
import threading
import time

from ..local.ourcode import written
from ..local.state import state_root
from .warm import APPEAR_WAIT, Forker, LINE_MAX, READY_WAIT, WarmChild, store_to_await, watch_orphan


def kept_dir(name):
    """Where a kept interpreter (node/attempt/keep.py) listens: the user's private state root, by its name."""
    return os.path.join(state_root(), ".warm-%s" % name)


class KeptWarm(Forker):
    """The agent's side of a kept interpreter: the Python session's (node/attempt/keep.py), made ready
    before this launch and used by every launch of the session. Warm's interface; each fork is a
    connection to its socket that stays open while the rank runs (the rank is killed if the
    connection ends first: this agent gone), as torchrun's stand-ins ask."""

    appear = APPEAR_WAIT  # seconds its socket may take to appear

    def __init__(self, name, report=None):
        self.path = self.socket = os.path.join(kept_dir(name), "sock")
        self.report, self.hello, self.asking, self.first_try = report, None, None, None

    @property
    def code(self):
        """Where torchrun's stand-ins import from (standin.CODE_VAR): beside its socket, which
        its keeper made before it answered."""
        return written(os.path.dirname(self.path))

    def answered(self, timeout):
        """Whether it said ready or cold within ``timeout`` seconds (its socket may not exist yet:
        its keeper was started with this launch)."""
        deadline = time.monotonic() + timeout
        while self.hello is None:
            try:
                self.asking = self.asking or self.connect(b'\n{"hello": 1}\n')
                self.asking.settimeout(max(0.01, deadline - time.monotonic()))
                line = self.asking.makefile("rb").readline(LINE_MAX)
                self.hello = json.loads(line) if line else {"cold": "the warm interpreter of this session ended"}
            except (FileNotFoundError, ConnectionRefusedError):
                self.first_try = self.first_try or time.monotonic()
                if time.monotonic() - self.first_try > self.appear:
                    self.hello = {"cold": "this session's warm interpreter is not there"}
                elif time.monotonic() >= deadline:
                    return False
                else:
                    time.sleep(0.05)  # its keeper, started with this launch, has not bound the socket yet
            except socket.timeout:
                return False
            except (OSError, ValueError) as e:
                self.hello = {"cold": "the warm interpreter of this session did not answer (%s)" % e}
            if self.hello is not None:
                self.asking = self.asking and self.asking.close()
                for notice in ([self.why_cold()] if "cold" in self.hello else []) + list(self.hello.get("notices") or ()):
                    self.report and self.report("ddp-up: warm start: %s\n" % notice)
        return True

    def ready(self, timeout=READY_WAIT):
        return self.answered(timeout) and "ready" in self.hello

    def give_up(self):
        """It took too long: this launch starts cold (the interpreter is the session's: it stays)."""
        self.hello = self.hello or {"cold": "the warm interpreter of this session was not ready in time"}

    def connect(self, first, fds=()):
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.path)
            conn.sendmsg([first[:1]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else [])
            conn.sendall(first[1:])
        except OSError:
            conn.close()
            raise
        return conn

    def fork(self, local_rank, argv, env, cwd, stdout=None, stderr=None, timeout=30.0, fds=None):
        if not self.usable():
            return None
        opened = [] if fds else [os.open(os.devnull, os.O_RDONLY)] + [
            os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            for path in (stdout, stderr)]
        request = json.dumps({"argv": list(argv), "env": dict(env), "cwd": cwd, **store_to_await(local_rank, argv)}).encode()
        try:
            conn = self.connect(b"\n" + request + b"\n", fds or opened)
        except OSError:
            return None
        finally:
            for fd in opened:
                os.close(fd)
        answers = conn.makefile("rb")
        try:
            conn.settimeout(timeout)
            answer = json.loads(answers.readline(LINE_MAX))
            if "cold" in answer:  # refused (beforefork.Seen.refusal): this launch starts cold, said once
                self.hello = {"cold": str(answer["cold"])}
                self.report and self.report("ddp-up: warm start: %s\n" % self.why_cold())
            child = WarmChild(int(answer["pid"]))
            conn.settimeout(None)
        except (OSError, ValueError, KeyError, TypeError):
            conn.close()
            return None
        threading.Thread(target=self.watch, args=(conn, answers, child), name="warm-rank", daemon=True).start()
        return child

    @staticmethod
    def watch(conn, answers, child):
        """Its end, as the interpreter reports it; if the interpreter went first, as its pid ends."""
        try:
            line = answers.readline(LINE_MAX)
            child.end(int(json.loads(line)["code"])) if line else watch_orphan(child)
        except (OSError, ValueError, KeyError, TypeError):
            watch_orphan(child)
        finally:
            conn.close()

    def close(self):
        """The interpreter is the session's: it forks the next launch's ranks."""
