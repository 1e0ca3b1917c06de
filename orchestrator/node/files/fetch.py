"""Fetch mode: the node's side of ddp-fetch, files back from the node (see the controller's fetch.py).

The agent lists the requested path (Listing: every regular file and symbolic link under it, with
size, mtime and mode), takes the indices the controller still needs (Want), and sends each of
those files as Chunk frames, then Sent. Links are listed as links and never followed: nothing
outside the requested tree is ever read. Only regular files are opened, without blocking (a FIFO
planted in a checkpoint folder cannot hold the agent). A file that changes while it is sent is
sent as it was read, and named in Sent: the controller says so.
"""

import os
import stat
import sys

from ..protocol import wire
from .sync import widen_pipe

CHUNK = 1 << 20  # bytes a Chunk frame carries at most
MOST_ENTRIES = 1000000  # a listing longer than this is refused (a path that names a whole disk)


def fetch(spec, writer, stream=None):
    """List, wait for Want (or the controller's end), send what it wants."""
    stream = stream if stream is not None else sys.stdin.buffer
    widen_pipe(sys.stdout.fileno())  # a megabyte per wake-up of the reader, as sync's stdin
    base = requested(spec.root, spec.path)
    try:
        entries, left_out = listing(base)
    except OSError as e:
        writer.send(wire.Failed("cannot read %s: %s" % (base, e.strerror or e),
                                "check the path (relative to the workdir, or absolute): ls -la %s" % base))
        writer.drain(5)
        return 3
    except ValueError as e:
        writer.send(wire.Failed(str(e), "fetch a folder below it"))
        writer.drain(5)
        return 3
    writer.send(wire.Listing(base=base, entries=entries, left_out=left_out or None))
    want = wire.read_frame(stream, wire.TO_AGENT)
    if not isinstance(want, wire.Want):
        return 0  # the controller has all it needs (or went away)
    sent, changed = send_files(base, entries, want.indices, Direct(writer))
    writer.send(wire.Sent(files=len(want.indices), bytes=sent, changed=changed or None))
    writer.drain(60)
    return 0


def requested(root, path):
    """The absolute path asked for: ``path`` as given if absolute, else under ``root`` (the workdir)."""
    return os.path.normpath(os.path.join(os.path.expanduser(root or "~"), os.path.expanduser(path)))


def listing(base):
    """([[rel, size, mtime_ns, mode, link]], [rel of what is left out, with why]) for ``base``: a
    file alone, or a directory walked without following links (rel "/"-separated, "" for a file
    named alone). The top path itself is followed if it is a link: the user named it."""
    st = os.stat(base)
    if stat.S_ISREG(st.st_mode):
        return [["", st.st_size, st.st_mtime_ns, stat.S_IMODE(st.st_mode), None]], []
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(0, "not a file or a folder")
    entries, left_out = [], []
    for top, dirs, files in os.walk(base, onerror=lambda e: left_out.append("%s (%s)" % (
            os.path.relpath(e.filename, base), e.strerror))):
        dirs.sort()
        for name in sorted(dirs + files):
            full = os.path.join(top, name)
            rel = os.path.relpath(full, base).replace(os.sep, "/")
            try:
                st = os.lstat(full)
            except OSError as e:
                left_out.append("%s (%s)" % (rel, e.strerror))
                continue
            if stat.S_ISLNK(st.st_mode):
                entries.append([rel, 0, st.st_mtime_ns, 0o777, os.readlink(full)])
                if name in dirs:
                    dirs.remove(name)  # os.walk does not descend into it anyway: said for the reader
            elif stat.S_ISREG(st.st_mode):
                entries.append([rel, st.st_size, st.st_mtime_ns, stat.S_IMODE(st.st_mode), None])
            elif not stat.S_ISDIR(st.st_mode):
                left_out.append("%s (not a regular file)" % rel)
        if len(entries) > MOST_ENTRIES:
            raise ValueError("%s holds more than %d files" % (base, MOST_ENTRIES))
    return entries, left_out


def send_files(base, entries, indices, writer):
    """Each wanted regular file's bytes as Chunk frames (its last one ``end``); (bytes sent, the
    indices of files that changed or vanished while sent)."""
    total, changed = 0, []
    for index in indices:
        if not (isinstance(index, int) and 0 <= index < len(entries)) or entries[index][4] is not None:
            continue
        rel, size = entries[index][0], entries[index][1]
        path = os.path.join(base, rel) if rel else base
        sent = send_one(path, index, writer)
        total += max(sent, 0)
        if sent != size:
            changed.append(index)
    return total, changed


class Direct:
    """Chunks straight to the agent's stdout, header and bytes in one writev from one reused
    buffer: no copy of a file's bytes on their way out but the kernel's. Fetch mode's Writer is
    idle meanwhile (drained first), so nothing else writes there."""

    def __init__(self, writer, fd=1):
        writer.drain(60)
        self.fd, self.buf = fd, bytearray(CHUNK)

    def send(self, frame, block=True):
        self.chunk(frame.index, frame.end, memoryview(frame.data))

    def chunk(self, index, end, data):
        parts = [wire.Chunk(index=index, end=end, data=b"").header(len(data)), data]
        while parts:
            done = os.writev(self.fd, parts)
            while parts and done >= len(parts[0]):
                done -= len(parts[0])
                parts.pop(0)
            if parts:
                parts[0] = memoryview(parts[0])[done:]


def send_one(path, index, out):
    """The bytes sent of one file (-1: it could not be opened as a regular file, sent empty)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        out.send(wire.Chunk(index=index, end=True, data=b""))
        return -1
    sent = 0
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            out.send(wire.Chunk(index=index, end=True, data=b""))
            return -1
        buf = getattr(out, "buf", None)
        while True:
            if buf is None:  # a plain writer (tests)
                data = os.read(fd, CHUNK)
                out.send(wire.Chunk(index=index, end=not data, data=data))
            else:
                got = os.readv(fd, [buf])
                data = memoryview(buf)[:got]
                out.chunk(index, not got, data)
            if not data:
                return sent
            sent += len(data)
    except OSError:
        out.send(wire.Chunk(index=index, end=True, data=b""))
        return -1
    finally:
        os.close(fd)
