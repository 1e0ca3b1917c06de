"""Controller side of the agent wire protocol (see agent.py for the frame list). Pure."""

from __future__ import annotations

import json
from functools import lru_cache
from typing import NamedTuple

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


class WorkerChunk(NamedTuple):
    """Whole lines one worker wrote to one stream (the payload of a ``W`` frame)."""

    stream: str  # "out" | "err"
    local_rank: int
    data: bytes

    def lines(self) -> list[str]:
        text = self.data.decode("utf-8", "replace")
        return [line.rstrip("\r") for line in text.split("\n")[:-1]]  # chunks end with a newline


class FrameReader:
    """Agent stdout -> ``(kind, payload)`` frames; ``W`` frames carry a WorkerChunk.

    Control frames are one line. A ``W STREAM RANK N`` header line is followed by N raw bytes,
    so whatever a worker prints (newlines, binary) can never be read as a frame.
    """

    def __init__(self) -> None:
        self.buf = bytearray()
        self.pending: tuple[str, int, int] | None = None  # a W header waiting for its bytes

    def feed(self, data: bytes) -> list[tuple[bytes, object]]:
        self.buf += data
        frames: list[tuple[bytes, object]] = []
        pos = 0
        while True:
            if self.pending is not None:
                stream, rank, size = self.pending
                if len(self.buf) - pos < size:
                    break
                frames.append((b"W", WorkerChunk(stream, rank, bytes(self.buf[pos:pos + size]))))
                pos += size
                self.pending = None
                continue
            end = self.buf.find(b"\n", pos)
            if end < 0:
                break
            kind, payload = split_frame(bytes(self.buf[pos:end]))
            pos = end + 1
            if kind == b"W":
                self.pending = _chunk_header(payload)
            else:
                frames.append((kind, payload))
        del self.buf[:pos]
        return frames


def _chunk_header(payload: bytes) -> tuple[str, int, int]:
    stream, rank, size = payload.split(b" ")
    return ("out" if stream == b"O" else "err"), int(rank), int(size)


def decode_json(payload: bytes) -> dict:
    try:
        value = json.loads(payload)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
