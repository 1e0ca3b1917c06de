"""What the controller sends first: the agent's sources and the bootstrap that runs them. Pure.

The frames themselves are defined once, in wire.py, for both ends.
"""

from __future__ import annotations

from functools import lru_cache

from . import agent, wire


def _read(module) -> bytes:
    with open(module.__file__, "rb") as f:
        return f.read()


@lru_cache(maxsize=1)
def sources() -> tuple[bytes, bytes]:
    """wire.py then agent.py, as shipped to every node."""
    return _read(wire), _read(agent)


def bootstrap_args() -> list[str]:
    """Arguments after ``python -u``: the bootstrap reads exactly these many bytes of each source.
    ``-S``: the agent is stdlib-only, and skipping `site` (its .pth files, its path scan) is a
    third of a bare interpreter's start-up, paid once per node."""
    wire_src, agent_src = sources()
    return ["-S", "-c", agent.BOOTSTRAP, str(len(wire_src)), str(len(agent_src))]


def hello(spec: wire.Frame) -> bytes:
    """The first bytes a node agent reads: the sources, then the spec frame that picks its mode."""
    assert isinstance(spec, wire.SPECS), spec
    return b"".join(sources()) + spec.encode()


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
