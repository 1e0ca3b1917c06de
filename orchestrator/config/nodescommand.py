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
import signal
import subprocess
import tempfile
import time

from ..errors import ConfigError
from .hostlists import parse_hostfile

COMMAND_WAIT = 60.0  # seconds the program may take
OUTPUT_MOST = 1 << 20  # bytes of its output: a node list is far smaller
ERROR_TAIL = 3  # lines of its stderr shown when it fails


def listed_nodes(command: str, path: str, line: int | None) -> list[dict]:
    """The program's node list as `nodes:` entries, or ConfigError naming the key and what went
    wrong (its exit status and the end of its stderr)."""
    def error(why: str) -> ConfigError:
        return ConfigError(path, line, "nodes_command", why)

    where = os.path.dirname(os.path.abspath(path)) if path else os.getcwd()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:  # files, not pipes: no deadlock on a flood
        try:
            proc = subprocess.Popen(["/bin/sh", "-c", command], stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    cwd=where, start_new_session=True)
        except OSError as e:
            raise error(f"cannot run it: {e.strerror or e}") from None
        ended = _ended(proc.pid, time.monotonic() + COMMAND_WAIT)
        # What it left running (a child in the background), or all of it if it did not end: its
        # group, which is ours as long as the program is not reaped (its pid holds the group's id).
        os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait()
        if not ended:
            raise error(f"did not finish within {COMMAND_WAIT:g} s; it must print the node list and exit")
        text, problem = _read(out), _tail(_read(err))
    if code != 0:
        status = f"signal {-code}" if code < 0 else f"status {code}"
        raise error(f"exited with {status}{': ' + problem if problem else ''}; it must print one `HOST slots=N` "
                    "line a node and exit 0")
    if text is None:
        raise error(f"printed more than {OUTPUT_MOST >> 20} MiB; it must print one `HOST slots=N` line a node")
    if not any(line.split("#", 1)[0].strip() for line in text.splitlines()):
        raise error("printed no host; it must print one `HOST slots=N` line a node (e.g. `gpu-a slots=8`)")
    try:
        return parse_hostfile(text, "nodes_command")
    except ConfigError as e:
        at = f" (line {e.line} of its output)" if e.line else ""
        raise error(f"{e.message}{at}") from None


def _ended(pid: int, deadline: float) -> bool:
    """Whether the program exited before ``deadline``, waiting without reaping it."""
    while True:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


def _read(f) -> str | None:
    f.seek(0)
    data = f.read(OUTPUT_MOST + 1)
    if len(data) > OUTPUT_MOST:
        return None
    return data.decode("utf-8", errors="replace")


def _tail(text: str | None) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return " | ".join(line[:300] for line in lines[-ERROR_TAIL:])
