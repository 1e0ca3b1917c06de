"""Files ddp-up writes on this machine where others may write too (a shared runs/ directory):
never through a link, a directory that is really one.
"""

from __future__ import annotations

import errno
import os
import stat


def own_dir(path: str, private: bool = False) -> str:
    """``path``, made if missing, and a real directory: a runs directory shared with other users
    may hold a link planted where a job's directory goes (writing through it would put the job's
    files, or overwrite others, wherever it points). ``private``: a job's own directory, made 0700
    and refused unless it is this user's (one another user made first would see every log)."""
    if private:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
    else:
        os.makedirs(path, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(errno.ELOOP, "a symbolic link is in the way, not a directory", path)
    if private and st.st_uid != os.getuid():
        raise OSError(errno.EPERM, "the directory belongs to another user (uid %d)" % st.st_uid, path)
    return path


def no_link_open(path: str, fresh: bool, mode: int = 0o600) -> int:
    """A file of ours, never through a link: ``fresh``, a new file in place of what was there (a
    link is removed, never followed); else appended to, refused if it is a link. ``mode``: private
    unless asked (a run's logs hold what its ranks printed: tokens, paths, data)."""
    if fresh:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        flags = os.O_CREAT | os.O_EXCL
    else:
        flags = os.O_CREAT | os.O_APPEND
    return os.open(path, os.O_WRONLY | flags | os.O_NOFOLLOW, mode)
