"""What ran, so that a result can be reproduced weeks later: ``runs/<job-id>/run.json`` (the
command line, where it ran from, ddp-up's and Python's versions, the git state), the cluster file
as used (``cluster.yaml``, secrets masked), and ``git.diff``: the uncommitted changes of the
checkout the job ran from (the ``sync:`` source, else the current directory), bounded in size;
untracked files are listed, never copied. Each node's python and torch are in ``summary.json``.

Taken before anything starts (a tree edited during the run must not be recorded instead), with
git's own plumbing, every call bounded; a directory that is no checkout, or no git, records none.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import threading
from dataclasses import dataclass, field
from importlib import metadata

from .ownfiles import no_link_open, own_dir
from .plan import mask_secrets, mask_values

DIFF_MAX = 1 << 20  # bytes of uncommitted changes kept; past it the diff is cut (and says so)
UNTRACKED_MAX = 1000  # untracked file names listed
GIT_TIMEOUT = 15.0


@dataclass(frozen=True)
class GitState:
    root: str
    commit: str
    branch: str | None
    diff: bytes = b""
    diff_cut: bool = False  # the diff was longer than DIFF_MAX
    untracked: tuple[str, ...] = ()
    untracked_more: int = 0  # untracked names past UNTRACKED_MAX, counted, not listed

    @property
    def dirty(self) -> bool:
        return bool(self.diff or self.untracked or self.untracked_more)

    def as_dict(self) -> dict:
        return {"root": self.root, "commit": self.commit, "branch": self.branch, "dirty": self.dirty,
                "diff_bytes": len(self.diff), "diff_cut": self.diff_cut, "untracked": list(self.untracked),
                "untracked_more": self.untracked_more}


def _git(cwd: str, *args: str, limit: int | None = None) -> bytes | None:
    """git's output, or None if it failed; with ``limit``, at most that many bytes (git is then
    stopped: a diff past the limit is not waited for)."""
    env = dict(os.environ, GIT_OPTIONAL_LOCKS="0", GIT_TERMINAL_PROMPT="0", LC_ALL="C")
    argv = ["git", "-C", cwd, *args]
    try:
        if limit is None:
            done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, env=env, timeout=GIT_TIMEOUT)
            return done.stdout if done.returncode == 0 else None
        with subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              env=env) as proc:
            timer = threading.Timer(GIT_TIMEOUT, proc.kill)  # a read that never ends, bounded too
            timer.start()
            try:
                return proc.stdout.read(limit)
            finally:
                timer.cancel()
                proc.kill()
    except (OSError, subprocess.TimeoutExpired):
        return None


def git_state(path: str) -> GitState | None:
    """The checkout at ``path``'s state, or None where it is none (or git is missing)."""
    root = _git(path, "rev-parse", "--show-toplevel")
    commit = _git(path, "rev-parse", "--verify", "-q", "HEAD") if root else None
    if not root or not commit:
        return None  # not a checkout, or one without a commit yet
    branch = (_git(path, "symbolic-ref", "-q", "--short", "HEAD") or b"").decode(errors="replace").strip() or None
    diff = _git(path, "diff", "HEAD", "--binary", "--no-color", "--no-ext-diff", limit=DIFF_MAX + 1) or b""
    listed = (_git(path, "ls-files", "--others", "--exclude-standard", "-z") or b"").split(b"\0")
    names = [n.decode(errors="replace") for n in listed if n]
    return GitState(root.decode(errors="replace").strip(), commit.decode().strip(), branch, diff[:DIFF_MAX],
                    len(diff) > DIFF_MAX, tuple(names[:UNTRACKED_MAX]), max(0, len(names) - UNTRACKED_MAX))


@dataclass
class RunRecord:
    """Taken at launch (``take``), written into the run's directory (``write``)."""

    argv: list[str]
    cwd: str
    cluster_path: str | None  # None: the nodes came from elsewhere (-H, --hostfile, a Slurm allocation)
    git: GitState | None
    versions: dict = field(default_factory=dict)

    @classmethod
    def take(cls, argv: list[str], cluster_path: str | None, source: str) -> RunRecord:
        try:
            version = metadata.version("ddp-up")
        except metadata.PackageNotFoundError:
            version = None
        return cls(list(argv), os.getcwd(), cluster_path, git_state(source),
                   {"ddp_up": version, "python": platform.python_version(), "controller": platform.node()})

    @property
    def commit(self) -> str | None:
        return self.git.commit if self.git else None

    def write(self, run_dir: str, secrets) -> None:
        """run.json, cluster.yaml (masked) and git.diff; OSError if the directory cannot take them."""
        where = own_dir(run_dir)
        cluster = self.cluster_path and os.path.abspath(self.cluster_path)
        record = {"command": self.argv, "cwd": self.cwd, "cluster_file": cluster, "versions": self.versions,
                  "git": self.git.as_dict() if self.git else None}
        _write(where, "run.json", (json.dumps(mask_values(record, secrets), indent=2) + "\n").encode())
        text = _read(cluster) if cluster is not None else None
        if text is not None:
            _write(where, "cluster.yaml", mask_secrets(text, secrets).encode())
        if self.git and self.git.diff:
            diff = self.git.diff.decode("utf-8", "surrogateescape")
            _write(where, "git.diff", mask_secrets(diff, secrets).encode("utf-8", "surrogateescape"))


def _read(path: str) -> str | None:
    """The cluster file as it is now (it was read a moment ago), or None if it is gone."""
    try:
        with open(path, "rb") as f:
            return f.read(1 << 20).decode("utf-8", "replace")
    except OSError:
        return None


def _write(where: str, name: str, data: bytes) -> None:
    with os.fdopen(no_link_open(os.path.join(where, name), fresh=True), "wb") as f:
        f.write(data)

