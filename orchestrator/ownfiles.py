"""Files ddp-up writes on this machine where others may write too (a shared runs/ directory):
never through a link, a directory that is really one.
"""

from __future__ import annotations

import errno
import os
import stat


def own_dir(path: str) -> str:
    """``path``, made if missing, and a real directory: a runs directory shared with other users
    may hold a link planted where a job's directory goes (writing through it would put the job's
    files, or overwrite others, wherever it points)."""
    os.makedirs(path, exist_ok=True)
    if not stat.S_ISDIR(os.lstat(path).st_mode):
        raise OSError(errno.ELOOP, "a symbolic link is in the way, not a directory", path)
    return path


def no_link_open(path: str, fresh: bool, mode: int = 0o666) -> int:
    """A file of ours, never through a link: ``fresh``, a new file in place of what was there (a
    link is removed, never followed); else appended to, refused if it is a link. ``mode``: before
    the umask (run logs keep the user's umask; a batch script is private)."""
    if fresh:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        flags = os.O_CREAT | os.O_EXCL
    else:
        flags = os.O_CREAT | os.O_APPEND
    return os.open(path, os.O_WRONLY | flags | os.O_NOFOLLOW, mode)
