"""What the controller sends first: the agent's sources and the bootstrap that runs them. Pure.

The frames themselves are defined once, in wire.py, for both ends.
"""

from __future__ import annotations

import importlib.util
import marshal
import sys
from functools import lru_cache

from . import agent, nodefacts, wire


def _read(module) -> bytes:
    with open(module.__file__, "rb") as f:
        return f.read()


SHIPPED = (wire, nodefacts, agent)  # the order agent.BOOTSTRAP reads them in
NAMES = ("ddp_up_wire", "ddp_up_nodefacts", "ddp_up_agent")


@lru_cache(maxsize=1)
def sources() -> tuple[bytes, ...]:
    """wire.py, nodefacts.py, agent.py, as shipped to every node."""
    return tuple(_read(module) for module in SHIPPED)


def bytecode_key() -> str:
    """What a node's Python must match to run this Python's bytecode (the bootstrap computes the
    same): the cache tag and the magic number, which changes with every bytecode format."""
    return "%s%s" % (sys.implementation.cache_tag, importlib.util.MAGIC_NUMBER.hex())


@lru_cache(maxsize=1)
def compiled() -> tuple[bytes, ...]:
    """The shipped modules compiled here, as the node would compile them (same names, no
    inherited __future__ flags); empty where this Python has no bytecode cache tag."""
    if sys.implementation.cache_tag is None:
        return (b"",) * len(SHIPPED)
    return tuple(marshal.dumps(compile(src, name, "exec", dont_inherit=True)) for src, name in zip(sources(), NAMES))


def shipped() -> tuple[bytes, ...]:
    """What the bootstrap reads, in order: the sources, then the same compiled."""
    return sources() + compiled()


def bootstrap_args() -> list[str]:
    """Arguments after ``python -u``: the bootstrap reads exactly these many bytes of each part.
    ``-S``: the agent is stdlib-only, and skipping `site` (its .pth files, its path scan) is a
    third of a bare interpreter's start-up, paid once per node."""
    return ["-S", "-c", agent.BOOTSTRAP, bytecode_key(), *(str(len(part)) for part in shipped())]


def hello(spec: wire.Frame | None) -> tuple[bytes, ...]:
    """The first bytes a node agent reads, in parts to write one after the other: the sources and
    their bytecode (shared by every node's connection, never copied per node), then the spec frame
    that picks its mode. Without ``spec``, the caller's first frame must be it (sync sends the
    tree once scanned; the agent starts meanwhile)."""
    assert spec is None or isinstance(spec, wire.SPECS), spec
    return shipped() + ((spec.encode(),) if spec is not None else ())


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
