"""What the controller sends first: the node package's modules and the bootstrap that runs them.

The frames themselves are defined once, in node/wire.py, for both ends.
"""

from __future__ import annotations

import importlib.util
import marshal
import sys
from functools import lru_cache
from pathlib import Path

from .. import node
from ..node import wire
from ..node.procs import AGENT_MARK

# Turns what the controller sends first on stdin into the running agent. argv[1] is the
# controller's bytecode key (cache tag and magic number), argv[2] the package's name on the node,
# argv[3] the shipped modules' names (node.SHIPPED, comma-separated), then the sizes of their
# sources and of the same compiled by the controller (marshal). It builds the package and runs
# each module in it, in order, from its bytecode when the node's Python has the same key
# (compiling is a quarter of the agent's start-up, paid per node), else from its source; then
# the package's main. The leading string (AGENT_MARK) names the agent early in its command line.
BOOTSTRAP = (AGENT_MARK + "import sys,types,marshal;a=sys.argv;p=a[2];N=a[3].split(',');n=len(N);"
             "r=sys.stdin.buffer.read;s=[r(int(x)) for x in a[4:4+2*n]];"
             "k='%s%s'%(sys.implementation.cache_tag,getattr(sys.modules.get('_frozen_importlib_external'),"
             "'MAGIC_NUMBER',b'').hex());m=sys.modules;P=m[p]=types.ModuleType(p);P.__path__=[];"
             "[(m.__setitem__(p+'.'+x,types.ModuleType(p+'.'+x)),setattr(P,x,m[p+'.'+x]),"
             "m[p+'.'+x].__dict__.update(__package__=p),exec(marshal.loads(s[n+i]) if a[1]==k and s[n+i] else "
             "compile(s[i],p+'.'+x,'exec',0,1,2),m[p+'.'+x].__dict__)) for i,x in enumerate(N)];m[p+'.main'].main()")
NAMES = tuple("%s.%s" % (node.PACKAGE, name) for name in node.SHIPPED)  # each module's name on a node
# Both ends compile the shipped modules without docstrings (and asserts, which they have none of):
# a sixth less bytecode to unpack on every node. The bootstrap's compile says the same (0,1,2).
OPTIMIZE = 2


def module_paths() -> tuple[Path, ...]:
    """The shipped modules' files, in node.SHIPPED's order."""
    here = Path(node.__file__).parent
    return tuple(here / f"{name}.py" for name in node.SHIPPED)


@lru_cache(maxsize=1)
def sources() -> tuple[bytes, ...]:
    """The shipped modules' sources, as sent to every node."""
    return tuple(path.read_bytes() for path in module_paths())


def bytecode_key() -> str:
    """What a node's Python must match to run this Python's bytecode (the bootstrap computes the
    same): the cache tag and the magic number, which changes with every bytecode format."""
    return "%s%s" % (sys.implementation.cache_tag, importlib.util.MAGIC_NUMBER.hex())


@lru_cache(maxsize=1)
def compiled() -> tuple[bytes, ...]:
    """The shipped modules compiled here, as the node would compile them (same names, no
    inherited __future__ flags, OPTIMIZE); empty where this Python has no bytecode cache tag."""
    if sys.implementation.cache_tag is None:
        return (b"",) * len(NAMES)
    return tuple(marshal.dumps(compile(src, name, "exec", dont_inherit=True, optimize=OPTIMIZE))
                 for src, name in zip(sources(), NAMES))


def shipped() -> tuple[bytes, ...]:
    """What the bootstrap reads, in order: the sources, then the same compiled."""
    return sources() + compiled()


def bootstrap_args() -> list[str]:
    """Arguments after ``python -u``: the bootstrap reads exactly these many bytes of each part.
    ``-S``: the agent is stdlib-only, and skipping `site` (its .pth files, its path scan) is a
    third of a bare interpreter's start-up, paid once per node."""
    return ["-S", "-c", BOOTSTRAP, bytecode_key(), node.PACKAGE, ",".join(node.SHIPPED),
            *(str(len(part)) for part in shipped())]


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
