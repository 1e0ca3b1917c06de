"""What the controller sends first: the node package's modules and the bootstrap that runs them.

The frames themselves are defined once, in node/wire.py, for both ends.
"""

from __future__ import annotations

import importlib.util
import marshal
import re
import sys
import threading
from functools import lru_cache
from pathlib import Path

from .. import node
from ..node import wire
from ..node.main import MODES
from ..node.procs import AGENT_MARK

# Turns what the controller sends first on stdin into the running agent. It reads one header line:
# the controller's bytecode key (cache tag and magic number), the package's name on the node, the
# shipped modules' names (comma-separated, in SHIPPED's order), then the sizes of their sources and
# of the same compiled by the controller (marshal). It builds the package and runs each module in
# it, in order, from its bytecode when the node's Python has the same key (compiling is a quarter
# of the agent's start-up, paid per node), else from its source; then the package's main. All of
# it travels on stdin, none on the command line, so the connection starts before the controller
# has compiled anything. The leading string (AGENT_MARK) names the agent early in its command line.
BOOTSTRAP = (AGENT_MARK + "import sys,types,marshal;i=sys.stdin.buffer;a=i.readline().decode().split();"
             "p=a[1];N=a[2].split(',');n=len(N);s=[i.read(int(x)) for x in a[3:3+2*n]];"
             "k='%s%s'%(sys.implementation.cache_tag,getattr(sys.modules.get('_frozen_importlib_external'),"
             "'MAGIC_NUMBER',b'').hex());m=sys.modules;P=m[p]=types.ModuleType(p);P.__path__=[];"
             "[(m.__setitem__(p+'.'+x,types.ModuleType(p+'.'+x)),setattr(P,x,m[p+'.'+x]),"
             "m[p+'.'+x].__dict__.update(__package__=p),exec(marshal.loads(s[n+i]) if a[0]==k and s[n+i] else "
             "compile(s[i],p+'.'+x,'exec',0,1,2),m[p+'.'+x].__dict__)) for i,x in enumerate(N)];m[p+'.main'].main()")
# Both ends compile the shipped modules without docstrings (and asserts, which they have none of):
# a sixth less bytecode to unpack on every node. The bootstrap's compile says the same (0,1,2).
OPTIMIZE = 2
# A shipped module's imports of its siblings, read from its source as text (parsing all of them
# would cost every command a tenth of a second); a unit test holds this to the parsed imports.
_SIBLINGS = re.compile(rb"^[ \t]*from \.(\w*) import \(?([\w, ]+)", re.M)


def module_paths() -> tuple[Path, ...]:
    """The shipped modules' files, in node.SHIPPED's order."""
    here = Path(node.__file__).parent
    return tuple(here / f"{name}.py" for name in node.SHIPPED)


@lru_cache(maxsize=1)
def _sources() -> dict[str, bytes]:
    return {name: path.read_bytes() for name, path in zip(node.SHIPPED, module_paths())}


def sources(names: tuple[str, ...] = node.SHIPPED) -> tuple[bytes, ...]:
    """The modules' sources, as sent to every node."""
    return tuple(_sources()[name] for name in names)


def siblings(source: bytes) -> set[str]:
    """The shipped modules ``source`` imports (at the top or inside a function)."""
    found = set()
    for module, names in _SIBLINGS.findall(source):
        found |= {module.decode()} if module else {n.strip().decode() for n in names.split(b",") if n.strip()}
    return found


@lru_cache(maxsize=None)
def modules_for(mode: type | None) -> tuple[str, ...]:
    """What an agent answering the spec frame ``mode`` runs, in SHIPPED's order: main, the module
    of that mode (main.MODES), and everything they import; every module where ``mode`` is None."""
    if mode is None:
        return node.SHIPPED
    wanted, todo = set(), ["main", MODES[mode].split(".")[0]]
    while todo:
        name = todo.pop()
        if name not in wanted:
            wanted.add(name)
            todo += siblings(_sources()[name])
    return tuple(name for name in node.SHIPPED if name in wanted)


def bytecode_key() -> str:
    """What a node's Python must match to run this Python's bytecode (the bootstrap computes the
    same): the cache tag and the magic number, which changes with every bytecode format."""
    return "%s%s" % (sys.implementation.cache_tag, importlib.util.MAGIC_NUMBER.hex())


@lru_cache(maxsize=None)
def _compiled(name: str) -> bytes:
    if sys.implementation.cache_tag is None:
        return b""
    return marshal.dumps(compile(_sources()[name], f"{node.PACKAGE}.{name}", "exec", dont_inherit=True,
                                 optimize=OPTIMIZE))


def compiled(names: tuple[str, ...] = node.SHIPPED) -> tuple[bytes, ...]:
    """The modules compiled here, as the node would compile them (same names, no inherited
    __future__ flags, OPTIMIZE); empty where this Python has no bytecode cache tag."""
    return tuple(_compiled(name) for name in names)


_SHIPPING = threading.Lock()  # every node's writer thread asks at once: one compiles, the others wait


def shipped(mode: type | None = None) -> tuple[bytes, ...]:
    """What the bootstrap reads, in order: the header line, the sources, then the same compiled."""
    with _SHIPPING:
        return _shipped(mode)


@lru_cache(maxsize=None)
def _shipped(mode: type | None) -> tuple[bytes, ...]:
    names = modules_for(mode)
    parts = sources(names) + compiled(names)
    header = " ".join([bytecode_key(), node.PACKAGE, ",".join(names), *(str(len(p)) for p in parts)])
    return (header.encode() + b"\n",) + parts


def bootstrap_args() -> list[str]:
    """Arguments after ``python -u``. ``-S``: the agent is stdlib-only, and skipping `site` (its
    .pth files, its path scan) is a third of a bare interpreter's start-up, paid once per node."""
    return ["-S", "-c", BOOTSTRAP]


def hello(spec: wire.Frame | None, mode: type | None = None) -> tuple[bytes, ...]:
    """The first bytes a node agent reads, in parts to write one after the other: the modules of
    the mode that answers ``spec`` (or ``mode``: every module when both are None), sources and
    bytecode made once per command and shared by every node's connection, then the spec frame.
    Without ``spec``, the caller's first frame must be it (sync sends the tree once scanned; the
    agent starts meanwhile)."""
    assert spec is None or isinstance(spec, wire.SPECS), spec
    return shipped(type(spec) if spec is not None else mode) + ((spec.encode(),) if spec is not None else ())


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
