"""`nodes_command:`: a program whose output is the node list (a cloud's instance group, a spot
pool), run here at the launch and again before each attempt (run/attempts.py).

Its output is a hostfile (``HOST slots=N`` a line, ``#`` comments), the format --hostfile takes,
and its nodes take the cluster file's settings as `nodes:` entries would. The program is the
user's own, run as the cluster file says, in the cluster file's folder, with this shell's
environment; it gets no input, and a bounded time and output: one that hangs or floods is an
error, as is one that fails or prints no host.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import threading
import time

from ..errors import ConfigError
from ..node.local.procs import own_pids, proc_bytes
from .hostlists import parse_hostfile

COMMAND_WAIT = 60.0  # seconds the program may take
OUTPUT_MOST = 1 << 20  # bytes of its output (and of its stderr): a node list is far smaller
ERROR_TAIL = 3  # lines of its stderr shown when it fails
LISTING_VAR = "DDP_UP_LISTING"  # in the program's environment: what it started is found again by it


def listed_nodes(command: str, path: str, line: int | None) -> list[dict]:
    """The program's node list as `nodes:` entries, or ConfigError naming the key and what went
    wrong (its exit status and the end of its stderr)."""
    def error(why: str) -> ConfigError:
        return ConfigError(path, line, "nodes_command", why)

    where = os.path.dirname(os.path.abspath(path)) if path else os.getcwd()
    token = secrets.token_hex(8)
    try:
        proc = subprocess.Popen(["/bin/sh", "-c", command], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, cwd=where, start_new_session=True,
                                env={**os.environ, LISTING_VAR: token})
    except OSError as e:
        raise error(f"cannot run it: {e.strerror or e}") from None
    out, err = Capped(proc.stdout), Capped(proc.stderr)
    ended = _ended(proc.pid, time.monotonic() + COMMAND_WAIT, lambda: out.over or err.over)
    # What it left running: its group (ours as long as the program is not reaped: its pid holds
    # the group's id), and whatever carries its mark, a child that left the group (setsid) too.
    os.killpg(proc.pid, signal.SIGKILL)
    code = proc.wait()
    _end_marked(token)
    text, problem = out.text(), _tail(err.text(strict=False))
    if out.over or err.over:
        raise error(f"printed more than {OUTPUT_MOST >> 20} MiB; it must print one `HOST slots=N` line a node")
    if not ended:
        raise error(f"did not finish within {COMMAND_WAIT:g} s; it must print the node list and exit")
    if code != 0:
        status = f"signal {-code}" if code < 0 else f"status {code}"
        raise error(f"exited with {status}{': ' + problem if problem else ''}; it must print one `HOST slots=N` "
                    "line a node and exit 0")
    if text is None:
        raise error("printed bytes that are not UTF-8; it must print one `HOST slots=N` line a node")
    if not any(line.split("#", 1)[0].strip() for line in text.splitlines()):
        raise error("printed no host; it must print one `HOST slots=N` line a node (e.g. `gpu-a slots=8`)")
    try:
        return parse_hostfile(text, "nodes_command")
    except ConfigError as e:
        at = f" (line {e.line} of its output)" if e.line else ""
        raise error(f"{e.message}{at}") from None


class Capped:
    """One of the program's streams, read on a thread of its own as it comes, up to OUTPUT_MOST:
    past it, ``over`` (the program is stopped at once, not once it ends: a flood never fills a disk)."""

    def __init__(self, stream) -> None:
        self.data, self.over = bytearray(), False
        self.reader = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self.reader.start()

    def _read(self, stream) -> None:
        with stream:
            while chunk := stream.read1(1 << 16):
                self.data += chunk
                if len(self.data) > OUTPUT_MOST:
                    self.over = True
                    return

    def text(self, strict: bool = True) -> str | None:
        """What it printed (None: not UTF-8, where ``strict``), once its stream has ended (bounded:
        the program's group is gone by then, and a child that holds the stream on is not waited for)."""
        self.reader.join(2.0)
        try:
            return bytes(self.data[:OUTPUT_MOST]).decode("utf-8", "strict" if strict else "replace")
        except UnicodeDecodeError:
            return None


def _ended(pid: int, deadline: float, flooded) -> bool:
    """Whether the program exited before ``deadline`` (and before it ``flooded``), waiting
    without reaping it."""
    while True:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None:
            return True
        if time.monotonic() >= deadline or flooded():
            return False
        time.sleep(0.02)


def _end_marked(token: str) -> None:
    """SIGKILL every process of this user whose environment carries the program's mark (Linux's
    /proc; elsewhere its group alone is ended): what it started and left behind, in a session of
    its own or not. Twice, bounded, for one that forked as the first was killed."""
    mark = f"{LISTING_VAR}={token}".encode()
    for _ in range(3):
        found = [pid for pid in own_pids() if mark in (proc_bytes(pid, "environ") or b"").split(b"\0")]
        if not found:
            return
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def _tail(text: str | None) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return " | ".join(line[:300] for line in lines[-ERROR_TAIL:])
