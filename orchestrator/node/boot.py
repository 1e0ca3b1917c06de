"""The agent's loader: what turns the bytes the controller sends first on stdin into the running
agent. It is never imported: the command line's few words (remote/protocol.STUB) read it from
stdin by its length and run it, and it reads the rest.

One header line: the controller's bytecode key (cache tag and magic number), the package's name
on the node, the shipped modules' dotted names (comma-separated, in node.SHIPPED's order), then
the sizes of their sources and of the same compiled by the controller (marshal). It builds the
package, rooms and all, and runs each module in it, in order, from its bytecode when this Python
has the same key (compiling is a quarter of the agent's start-up, paid per node), else from its
source; then the package's main. The sources stay with the package (SOURCES): the user's Python
runs some of them (the userpython room) from files the agent writes.
"""

import marshal
import sys
import types

OPTIMIZE = 2  # as the controller compiles them (remote/protocol.OPTIMIZE): no docstrings, no asserts


def bytecode_key():
    magic = getattr(sys.modules.get("_frozen_importlib_external"), "MAGIC_NUMBER", b"")
    return "%s%s" % (sys.implementation.cache_tag, magic.hex())


def package(name):
    """The (empty) package ``name``, made and hung on its parent if it is not there yet."""
    if name not in sys.modules:
        made = sys.modules[name] = types.ModuleType(name)
        made.__path__, made.__package__ = [], name
        parent, _, last = name.rpartition(".")
        if parent:
            setattr(package(parent), last, made)
    return sys.modules[name]


def load(stdin):
    """Every shipped module, run in order; returns the package's main module."""
    key, root, names, *sizes = stdin.readline().decode().split()
    names = names.split(",")
    parts = [stdin.read(int(size)) for size in sizes]
    sources, compiled = parts[:len(names)], parts[len(names):]
    package(root).SOURCES = dict(zip(names, sources))
    same = key == bytecode_key()
    for name, source, code in zip(names, sources, compiled):
        full = "%s.%s" % (root, name)
        where, _, last = full.rpartition(".")
        module = sys.modules[full] = types.ModuleType(full)
        module.__package__ = where
        setattr(package(where), last, module)
        exec(marshal.loads(code) if same and code else compile(source, full, "exec", 0, True, OPTIMIZE),
             module.__dict__)
    return sys.modules[root + ".main"]


if __name__ == "__main__":
    load(sys.stdin.buffer).main()
