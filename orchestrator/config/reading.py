"""Reading the user's files: UTF-8 text, and YAML with the line of every key (for messages that
name the line), duplicate keys refused, and alias bombs bounded.
"""

from __future__ import annotations

import errno
import os
import select
import stat
import time
from typing import Any

import yaml

from ..errors import ConfigError

MAX_YAML_NODES = 100_000  # a cluster file has hundreds; more is an alias bomb or not a cluster file


PIPE_WAIT = 10.0  # seconds a pipe given as a file (`<(...)`, a FIFO) may take to say everything
TEXT_MOST = 16 << 20  # bytes of a cluster file, hostfile or env file: a larger one is not one


def read_text(path: str, what: str) -> str:
    """A UTF-8 text file, or ConfigError naming the file (and the line of a byte that is not UTF-8).
    Read once (what was parsed is what the run records) and never blocking for long: a FIFO
    nobody writes to, or a pipe that never ends, is an error after PIPE_WAIT seconds."""
    try:
        data = _read_bounded(path)
    except OSError as e:
        raise ConfigError(path, None, "", f"cannot read {what}: {e.strerror}") from None
    if data is None:
        raise ConfigError(path, None, "", f"cannot read {what}: the pipe did not end within {PIPE_WAIT:.0f} s "
                                          "(nothing writes to it?)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise ConfigError(path, line, "", f"{what} is not UTF-8 text (byte 0x{data[e.start]:02x}); "
                                          "save it as UTF-8") from None


def _read_bounded(path: str) -> bytes | None:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode):
            if st.st_size > TEXT_MOST:
                _too_big(path)
            with os.fdopen(os.dup(fd), "rb") as f:
                return f.read(TEXT_MOST)
        chunks, deadline = [], time.monotonic() + PIPE_WAIT
        while sum(map(len, chunks)) <= TEXT_MOST:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                continue
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
        _too_big(path)
    finally:
        os.close(fd)


def _too_big(path: str) -> None:
    raise OSError(errno.EFBIG, f"larger than {TEXT_MOST >> 20} MB: not a settings file", path)


def load_yaml(text: str, path: str) -> tuple[Any, dict[tuple, int]]:
    loader = yaml.SafeLoader(text)
    lines: dict[tuple, int] = {}
    try:
        root = loader.get_single_node()
        if root is not None:  # before constructing: merge keys (`<<: *defaults`) rewrite the nodes
            _index_lines(root, (), lines, path, set())
        data = loader.construct_document(root) if root is not None else None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark else None
        raise ConfigError(path, line, "", f"invalid YAML: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise ConfigError(path, None, "", f"invalid YAML: {e}") from None
    except ValueError as e:  # a value PyYAML's constructors refuse, past what _index_lines checks
        raise ConfigError(path, None, "", f"a value that cannot be read: {e}") from None
    except RecursionError:
        raise ConfigError(path, None, "", "nested too deeply to be a cluster file") from None
    finally:
        loader.dispose()
    return data, lines


def _index_lines(node: yaml.Node, at: tuple, lines: dict[tuple, int], path: str, seen_nodes: set[int]) -> None:
    """The line of every key path; duplicate keys are errors. A node reached again through an
    alias is not walked again, so an alias bomb costs its size, not its expansion."""
    lines[at] = node.start_mark.line + 1
    if id(node) in seen_nodes:
        return
    seen_nodes.add(id(node))
    if len(seen_nodes) > MAX_YAML_NODES:
        raise ConfigError(path, node.start_mark.line + 1, key_path(at),
                          f"more than {MAX_YAML_NODES:,} YAML nodes: not a cluster file")
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key_node, value_node in node.value:
            key = key_node.value
            line = key_node.start_mark.line + 1
            _check_number(key_node, at, path)
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults`: later keys override it
                _index_lines(value_node, at, lines, path, seen_nodes)
                continue
            if not isinstance(key, str):
                raise ConfigError(path, line, key_path(at), "a key must be a plain name")
            if key in seen:
                raise ConfigError(path, line, key_path(at + (key,)),
                                  f"duplicate key (first set on line {seen[key]})")
            seen[key] = line
            _index_lines(value_node, at + (key,), lines, path, seen_nodes)
            lines[at + (key,)] = line
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _index_lines(item, at + (i,), lines, path, seen_nodes)
    else:
        _check_number(node, at, path)


DIGITS_MOST = 4300  # Python's limit on converting an integer to and from text (sys.int_info.default_max_str_digits)


def _check_number(node: yaml.Node, at: tuple, path: str) -> None:
    """An integer longer than Python converts is an error at its line, before PyYAML converts it:
    past that, int() and repr() raise a ValueError with no line, in the reader or in a message."""
    if node.tag == "tag:yaml.org,2002:int" and len(str(node.value)) > DIGITS_MOST:
        raise ConfigError(path, node.start_mark.line + 1, key_path(at),
                          f"an integer of {len(node.value):,} characters: no value of a cluster file is that long")


def key_path(at: tuple) -> str:
    out = ""
    for part in at:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out
