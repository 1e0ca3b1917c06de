"""Controller side of the agent wire protocol (see agent.py for the frame list). Pure."""

from __future__ import annotations

import json
from functools import lru_cache

from . import agent

HEARTBEAT = b"H\n"
STOP = b"T\n"
KILL = b"K\n"
DUMP = b"D\n"


@lru_cache(maxsize=1)
def agent_source() -> bytes:
    return agent.source()


def bootstrap_args() -> list[str]:
    """Arguments after ``python -u``: the bootstrap reads exactly this many source bytes."""
    return ["-c", agent.BOOTSTRAP, str(len(agent_source()))]


def hello(spec: dict) -> bytes:
    """The first bytes a node agent reads: its own source, then its spec."""
    return agent_source() + json.dumps(spec).encode() + b"\n"


def probe(addr: str, port: int, timeout: float) -> bytes:
    """Ask an agent to open a TCP connection to addr:port and report."""
    return b"C " + json.dumps({"addr": addr, "port": port, "timeout": timeout}).encode() + b"\n"


def go(argv: list[str]) -> bytes:
    return b"G " + json.dumps({"argv": argv}).encode() + b"\n"


class LineSplitter:
    """Turns a byte stream into whole lines; keeps the partial tail for the next chunk."""

    def __init__(self) -> None:
        self.rest = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        lines = (self.rest + chunk).split(b"\n")
        self.rest = lines.pop()
        return lines

    def flush(self) -> list[bytes]:
        rest, self.rest = self.rest, b""
        return [rest] if rest else []


def split_frame(line: bytes) -> tuple[bytes, bytes]:
    """``b'O text'`` -> ``(b'O', b'text')``."""
    kind, _, payload = line.partition(b" ")
    return kind, payload


def decode_json(payload: bytes) -> dict:
    try:
        value = json.loads(payload)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
