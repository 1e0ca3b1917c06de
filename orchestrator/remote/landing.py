"""Where fetched files land: under the folder the user named, reached one part at a time through
directory descriptors (openat with O_NOFOLLOW), so that no link already there, or planted while
the copy runs, is ever followed. The folder the user named is followed if it is a link (they
named it); nothing below it is.

Temp files have names of a fixed length (never the file's name plus a suffix, which can pass
NAME_MAX) and a token of their copy's own: two copies into one folder never share one.
"""

from __future__ import annotations

import errno
import os
import stat
from collections import OrderedDict

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
OPEN_DIRS = 32  # directory descriptors kept open (a listing is sorted: files of one folder come together)
TEMP_PREFIX = ".ddp-up-fetch-"


class Landing:
    """The local tree of one node's copy: ``top`` (the folder the user named), then the ``under``
    parts ddp-up made safe (the node's folder, the copy's name), then the node's relative paths."""

    def __init__(self, top: str, under: tuple[str, ...]):
        self.top, self.under = top, under
        self.token = os.urandom(6).hex()
        os.makedirs(top, exist_ok=True)
        self.top_fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self.dirs: OrderedDict[tuple[str, ...], int] = OrderedDict()

    def parts(self, rel: str) -> tuple[str, ...]:
        return self.under + (tuple(rel.split("/")) if rel else ())

    def shown(self, rel: str = "") -> str:
        """The local path of ``rel``, for messages."""
        return os.path.join(self.top, *self.parts(rel))

    def folder(self, parts: tuple[str, ...], create: bool) -> int | None:
        """A descriptor of the folder ``parts`` below the top (owned by this object), made if
        missing and ``create``, else None where it is missing. A link or a file on the way is
        an OSError naming it."""
        if not parts:
            return self.top_fd
        if parts in self.dirs:
            self.dirs.move_to_end(parts)
            return self.dirs[parts]
        parent = self.folder(parts[:-1], create)
        if parent is None:
            return None
        try:
            fd = self._open_dir(parent, parts, create)
        except FileNotFoundError:
            return None
        self.dirs[parts] = fd
        while len(self.dirs) > OPEN_DIRS:
            os.close(self.dirs.popitem(last=False)[1])
        return fd

    def _open_dir(self, parent: int, parts: tuple[str, ...], create: bool) -> int:
        name = parts[-1]
        if create:
            try:
                os.mkdir(name, 0o777, dir_fd=parent)
            except FileExistsError:
                pass
        try:
            return os.open(name, DIR_FLAGS, dir_fd=parent)
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            where = os.path.join(self.top, *parts)
            if stat.S_ISLNK(os.lstat(name, dir_fd=parent).st_mode):
                raise OSError(errno.ELOOP, f"{where} is a symbolic link here, and fetch never writes through one") from None
            raise OSError(errno.ENOTDIR, f"{where} is a file here, where the node has a folder") from None

    def lstat(self, rel: str) -> os.stat_result | None:
        """What is at ``rel`` here (not followed), or None: nothing, or no folder for it yet."""
        parts = self.parts(rel)
        fd = self.folder(parts[:-1], create=False)
        if fd is None:
            return None
        try:
            return os.lstat(parts[-1], dir_fd=fd)
        except FileNotFoundError:
            return None

    def readlink(self, rel: str) -> str | None:
        parts = self.parts(rel)
        fd = self.folder(parts[:-1], create=False)
        try:
            return None if fd is None else os.readlink(parts[-1], dir_fd=fd)
        except OSError:
            return None

    def temp_name(self, index: int) -> str:
        """Entry ``index``'s temp name: of a fixed length, and this copy's own."""
        return f"{TEMP_PREFIX}{self.token}-{index}"

    def temp_file(self, rel: str, index: int) -> tuple[int, int, str]:
        """A new private temp file beside ``rel``'s place: (its descriptor, a descriptor of its
        folder, its name)."""
        folder = os.dup(self.folder(self.parts(rel)[:-1], create=True))
        name = self.temp_name(index)
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=folder)
        except OSError:
            os.close(folder)
            raise
        return fd, folder, name

    def place(self, folder: int, temp: str, rel: str) -> None:
        """The whole temp file renamed into ``rel``'s place, in one step."""
        os.replace(temp, self.parts(rel)[-1], src_dir_fd=folder, dst_dir_fd=folder)

    def link(self, rel: str, target: str, index: int) -> None:
        """A link to ``target`` at ``rel``, in place of what was there (a file or a link)."""
        parts = self.parts(rel)
        folder = self.folder(parts[:-1], create=True)
        temp = self.temp_name(index)
        os.symlink(target, temp, dir_fd=folder)
        try:
            os.replace(temp, parts[-1], src_dir_fd=folder, dst_dir_fd=folder)
        except OSError:
            unlink_quietly(temp, folder)
            raise

    def close(self) -> None:
        for fd in self.dirs.values():
            os.close(fd)
        self.dirs.clear()
        if self.top_fd >= 0:
            os.close(self.top_fd)
            self.top_fd = -1


def unlink_quietly(name: str, folder: int) -> None:
    try:
        os.unlink(name, dir_fd=folder)
    except OSError:
        pass
