"""Files ddp-up writes on this machine where others may write too (a shared runs/ directory):
never through a link, a directory that is really one.
"""

from __future__ import annotations

import errno
import os
import re
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


NAME_MOST = 200  # bytes of a name ddp-up makes: under NAME_MAX (255) with room for a suffix
_UNSAFE = re.compile(r"[^\w.@+=,-]+")


def safe_name(text: str) -> str:
    """A file name ddp-up makes from text it did not choose (a node's label, a path's last part):
    letters, digits and ``. _ - @ + = ,`` kept, every other run of characters one ``_``; never
    empty, ``.``, ``..`` or hidden, and at most NAME_MOST bytes (``host: ../../x`` is ``_.._.._x``)."""
    name = _UNSAFE.sub("_", "".join(c if c.isprintable() else "_" for c in text))
    if not name or name.startswith("."):
        name = "_" + name
    return name.encode()[:NAME_MOST].decode("utf-8", "ignore")  # cut at a whole character: linear in any label


NO_NAME_OF_ITS_OWN = ("names no file or folder of its own (a whole disk or home, or a path ending in . or ..): "
                      "name the folder itself, by its absolute path or its path in the workdir")
# A path to fetch whose copy has a name of its own: not one ending in . or .. (ckpt/.. is the
# workdir), not slashes alone (/), not a home (~, ~user). One pattern: ddp-fetch and the validator
# apply it (fetch_name) and the cluster file's schema says it, so an editor refuses what they refuse.
FETCH_PATH = r"^(?!.*(^\s*|/)\.{1,2}/*\s*$)(?!\s*/+\s*$)(?!\s*~[^/]*/*\s*$)"


def fetch_name(remote_path: str) -> str | None:
    """The name a fetched path's copy takes here (copy_name), of a path FETCH_PATH takes; None else."""
    return copy_name(remote_path) if re.search(FETCH_PATH, remote_path) else None


def copy_name(remote_path: str) -> str | None:
    """The name a fetched path's copy takes here: its last part, made safe; None for a path that
    names no file of its own (``/``, ``.``, ``..``, ``ckpt/..``, ``~``, ``~user``): its copy would
    land beside the folder asked for, or hold a whole home or file system."""
    path = os.path.normpath(remote_path.strip())
    last = os.path.basename(path)
    if last in ("", ".", "..") or path.startswith("~") and "/" not in path:
        return None
    return safe_name(last)
