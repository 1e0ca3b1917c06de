"""What the controller sends first: the node package's modules and the bootstrap that runs them.

The frames themselves are defined once, in node/protocol/wire.py, for both ends.
"""

from __future__ import annotations

import hashlib
import marshal
import os
import sys
import threading
from functools import lru_cache
from pathlib import Path
from typing import Mapping

from .. import node
from ..node import boot
from ..node.protocol import wire
from ..node.main import MODES
from ..node.local.procs import AGENT_MARK, TAG_JOB, TAG_KEEP, TAG_NODE
from ..node.local.state import private_dir, read_regular
from ..ownfiles import no_link_open, own_dir

# The agent's whole command line: these words, which read the loader (node/boot.py) from stdin by
# its length and run it, then its name in ps (title). All the code travels on stdin, so the
# connection starts before the controller has compiled anything.
STUB = "import sys;i=sys.stdin.buffer;exec(i.read(int(i.readline())))"
# Both ends compile the shipped modules without docstrings (and asserts, which they have none of):
# a sixth less bytecode to unpack on every node. The loader's compile says the same.
OPTIMIZE = boot.OPTIMIZE


def module_paths(names: tuple[str, ...] = node.SHIPPED) -> tuple[Path, ...]:
    """The files of node modules by their dotted names (node.SHIPPED's by default)."""
    return tuple(node.path(name) for name in names)


def sources(names: tuple[str, ...] = node.SHIPPED) -> tuple[bytes, ...]:
    """The modules' sources, as sent to every node."""
    return tuple(node.source(name) for name in names)


@lru_cache(maxsize=None)
def modules_for(mode: type | None) -> tuple[str, ...]:
    """What an agent answering the spec frame ``mode`` runs, in SHIPPED's order: main, the module
    of that mode (main.MODES), and everything they import; every module where ``mode`` is None."""
    if mode is None:
        return node.SHIPPED
    return node.needs("main", MODES[mode].rpartition(".")[0])


def bytecode_key() -> str:
    """What a node's Python must match to run this Python's bytecode: the cache tag and the magic
    number, which changes with every bytecode format (the loader's own rule, boot.bytecode_key)."""
    return boot.bytecode_key()


# Compiling the node package costs every command 0.1 s of CPU (55 modules), each time: the bytecode
# is kept in the user's own cache folder (private), a file a module named by what it depends on:
# this Python's bytecode key, OPTIMIZE and the source. The nodes run it: a file is read only from
# a folder of this user's that no one else may write, and one that does not begin with the digest
# of the rest (cut short, damaged) is compiled again.
DIGEST = hashlib.sha256().digest_size


@lru_cache(maxsize=None)
def _compiled(name: str) -> bytes:
    if sys.implementation.cache_tag is None:
        return b""
    source = node.source(name)
    path = kept_path(name, source)
    kept = read_kept(path)
    if kept is not None:
        return kept
    code = marshal.dumps(compile(source, f"{node.PACKAGE}.{name}", "exec", dont_inherit=True, optimize=OPTIMIZE))
    keep(path, code)
    return code


def kept_path(name: str, source: bytes) -> str | None:
    """Where the bytecode of module ``name`` with this ``source`` is kept; None: no cache folder."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    if not os.path.isabs(cache):
        return None
    key = hashlib.sha256(b"%s %d\n" % (bytecode_key().encode(), OPTIMIZE) + source).hexdigest()[:32]
    return os.path.join(cache, "ddp-up", "bytecode", f"{name}-{key}")


def read_kept(path: str | None) -> bytes | None:
    if path is None or private_dir(os.path.dirname(path), create=False) is not None:
        return None  # missing, a link, another user's, or one others may write into
    raw, _ = read_regular(path, 8 << 20)
    if raw is None or hashlib.sha256(raw[DIGEST:]).digest() != raw[:DIGEST]:
        return None
    return raw[DIGEST:]


def keep(path: str | None, code: bytes) -> None:
    """Kept for the next command, best effort (a read-only home compiles each time)."""
    if path is None:
        return
    folder, name = os.path.split(path)
    try:
        own_dir(os.path.dirname(folder), private=True)
        own_dir(folder, private=True)
        tmp = os.path.join(folder, f".{name}.{os.getpid()}.tmp")
        with os.fdopen(no_link_open(tmp, fresh=True), "wb") as f:
            f.write(hashlib.sha256(code).digest() + code)
        os.replace(tmp, path)
        module = name.rpartition("-")[0]
        for old in os.listdir(folder):  # the same module's bytecode of an earlier source: never read again
            if old != name and old.rpartition("-")[0] == module:
                os.unlink(os.path.join(folder, old))
    except OSError:
        pass


def compiled(names: tuple[str, ...] = node.SHIPPED) -> tuple[bytes, ...]:
    """The modules compiled here, as the node would compile them (same names, no inherited
    __future__ flags, OPTIMIZE); empty where this Python has no bytecode cache tag."""
    return tuple(_compiled(name) for name in names)


_SHIPPING = threading.Lock()  # every node's writer thread asks at once: one compiles, the others wait


def shipped(mode: type | None = None) -> tuple[bytes, ...]:
    """What the agent reads first, in order: the loader (its length on a line, then its source),
    the loader's header line, the sources, then the same compiled."""
    with _SHIPPING:
        return _shipped(mode)


@lru_cache(maxsize=None)
def _shipped(mode: type | None) -> tuple[bytes, ...]:
    names = modules_for(mode)
    parts = sources(names) + compiled(names)
    header = " ".join([bytecode_key(), node.PACKAGE, ",".join(names), *(str(len(p)) for p in parts)])
    loader = Path(boot.__file__).read_bytes()
    return (b"%d\n" % len(loader), loader, header.encode() + b"\n") + parts


def title(tags: Mapping[str, str] | None = None) -> list[str]:
    """The agent's name in ps, as words after STUB: AGENT_MARK, then its job (or kept session) and
    node, as far as ``tags`` say them. The agent keeps only these words on its command line."""
    said = [(word, (tags or {}).get(tag)) for word, tag in (("job", TAG_JOB), ("keep", TAG_KEEP), ("node", TAG_NODE))]
    return [AGENT_MARK] + ["%s=%s" % (word, value) for word, value in said if value]


def bootstrap_args(tags: Mapping[str, str] | None = None) -> list[str]:
    """Arguments after ``python -u``. ``-S``: the agent is stdlib-only, and skipping `site` (its
    .pth files, its path scan) is a third of a bare interpreter's start-up, paid once per node."""
    return ["-S", "-c", STUB, *title(tags)]


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
