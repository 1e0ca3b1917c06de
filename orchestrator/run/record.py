"""What ran, so that a result can be reproduced weeks later: ``runs/<job-id>/run.json`` (the
command line, where it ran from, ddp-up's and Python's versions, the git state), the cluster file
as used (``cluster.yaml``, secrets masked), and ``git.diff``: the uncommitted changes of the
checkout the job ran from (the ``sync:`` source, else the current directory), bounded in size;
untracked files are listed, never copied. Each node's python and torch are in ``summary.json``.

Taken as the launch begins (a tree edited during the run must not be recorded instead), with
git's own plumbing, within GIT_BUDGET seconds in all (the launch waits for the commit alone), and with what a
checkout's own configuration could run switched off: its fsmonitor, hooks, external diff and
textconv drivers (a tree from an untrusted archive runs no code here, and the diff is the raw
change). A directory that is no checkout, or no git, records none. The cluster file's copy is
made from the text that was parsed (never read again), masked as data. git.diff holds no binary
patch (it could rebuild a secret) and no file whose name says it holds one (SECRET_FILES); the
names left out are in run.json. Every file here is private to the user (0600 in a 0700 directory).
"""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field

from ..config.clusterfile import masked_copy
from ..config.masking import mask_secrets, mask_values
from ..node.local.state import JOB_ID, read_regular
from ..ownfiles import no_link_open, own_dir
from ..version import __version__

DIFF_MAX = 1 << 20  # bytes of uncommitted changes kept; past it the diff is cut (and says so)
UNTRACKED_MAX = 1000  # untracked file names listed
# seconds for all of git's calls together. They run while the launch connects (RecordTaking), and the
# launch waits for the first two alone (the commit): 2 s cut the untracked files' scan of a tiny
# checkout short on a loaded 2-core machine (four test workers); a 60,000-file checkout took 0.9 s
GIT_BUDGET = 5.0
TAKE_SLACK = 1.0  # seconds past the budget for the rest of the record (the Python around git's calls)
# Turned off, whatever the checkout's own .git/config says: each could run code from the tree.
GIT_SAFE = ("-c", "core.fsmonitor=false", "-c", "core.hooksPath=/dev/null", "-c", "diff.external=",
            "-c", "core.untrackedCache=false")
SECRET_FILES = ("*secret*", "*token*", "*password*", "*passwd*", "*credential*", "*.pem", "*.key", "*.p12",
                "id_rsa*", "id_ecdsa*", "id_ed25519*", ".env", ".env.*", "*.env", ".netrc", ".pgpass")


@dataclass(frozen=True)
class GitState:
    root: str
    commit: str
    branch: str | None
    diff: bytes = b""
    diff_cut: bool = False  # the diff was longer than DIFF_MAX
    untracked: tuple[str, ...] = ()
    untracked_more: int = 0  # untracked names past UNTRACKED_MAX, counted, not listed
    left_out: tuple[str, ...] = ()  # changed files kept out of the diff: their names say they hold secrets

    @property
    def dirty(self) -> bool:
        return bool(self.diff or self.untracked or self.untracked_more)

    def as_dict(self) -> dict:
        return {"root": self.root, "commit": self.commit, "branch": self.branch, "dirty": self.dirty,
                "diff_bytes": len(self.diff), "diff_cut": self.diff_cut, "diff_left_out": list(self.left_out),
                "untracked": list(self.untracked), "untracked_more": self.untracked_more}


def _git(cwd: str, *args: str, deadline: float, limit: int | None = None) -> bytes | None:
    """git's output, or None if it failed or ``deadline`` (monotonic) passed; with ``limit``, at
    most that many bytes (git is then stopped: a diff past the limit is not waited for)."""
    env = dict(os.environ, GIT_OPTIONAL_LOCKS="0", GIT_TERMINAL_PROMPT="0", LC_ALL="C", GIT_CONFIG_NOSYSTEM="1")
    argv = ["git", *GIT_SAFE, "-C", cwd, *args]
    left = deadline - time.monotonic()
    if left <= 0:
        return None
    try:
        with subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              env=env, start_new_session=True) as proc:
            # the whole group: what git started (a pager, a helper) holds the pipe open too
            timer = threading.Timer(left, _kill_group, (proc.pid,))
            timer.start()
            try:
                out = proc.stdout.read(limit if limit is not None else -1)
            finally:
                timer.cancel()
                if limit is not None:
                    _kill_group(proc.pid)
            return out if limit is not None or proc.wait() == 0 else None
    except OSError:
        return None


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass  # gone already


def excluded(patterns: tuple[str, ...]) -> list[str]:
    """git pathspecs leaving out files whose names match ``patterns`` (any letter case, anywhere)."""
    return [f":(exclude,glob,icase)**/{p}" for p in patterns]


def git_state(path: str, budget: float | None = None, on_commit=lambda commit: None) -> GitState | None:
    """The checkout at ``path``'s state, or None where it is none (or git is missing, or slower
    than ``budget`` seconds in all, GIT_BUDGET unless given). ``on_commit`` is given the commit (or
    None) as soon as it is known: the diff and the untracked files, which read the whole tree, come after."""
    deadline = time.monotonic() + (GIT_BUDGET if budget is None else budget)
    root = _git(path, "rev-parse", "--show-toplevel", deadline=deadline)
    commit = _git(path, "rev-parse", "--verify", "-q", "HEAD", deadline=deadline) if root else None
    on_commit(commit.decode().strip() if root and commit else None)
    if not root or not commit:
        return None  # not a checkout, or one without a commit yet
    branch = (_git(path, "symbolic-ref", "-q", "--short", "HEAD", deadline=deadline) or b"").decode(
        errors="replace").strip() or None
    diff = _git(path, "diff", "HEAD", "--no-color", "--no-ext-diff", "--no-textconv", "--", ".",
                *excluded(SECRET_FILES), deadline=deadline, limit=DIFF_MAX + 1) or b""
    held = (_git(path, "diff", "HEAD", "--name-only", "-z", "--", *(f":(glob,icase)**/{p}" for p in SECRET_FILES),
                 deadline=deadline) or b"").split(b"\0")
    listed = (_git(path, "ls-files", "--others", "--exclude-standard", "-z", deadline=deadline) or b"").split(b"\0")
    names = [n.decode(errors="replace") for n in listed if n]
    return GitState(root.decode(errors="replace").strip(), commit.decode().strip(), branch, diff[:DIFF_MAX],
                    len(diff) > DIFF_MAX, tuple(names[:UNTRACKED_MAX]), max(0, len(names) - UNTRACKED_MAX),
                    tuple(n.decode(errors="replace") for n in held if n))


@dataclass
class RunRecord:
    """Taken at launch (``take``), written into the run's directory (``write``)."""

    argv: list[str]
    cwd: str
    cluster_path: str | None  # None: the nodes came from elsewhere (-H, --hostfile, a Slurm allocation)
    git: GitState | None
    versions: dict = field(default_factory=dict)
    cluster_text: str = ""  # the cluster file as it was parsed (config.ClusterConfig.source_text)

    @classmethod
    def take(cls, argv: list[str], cluster_path: str | None, source: str, cluster_text: str = "",
             on_commit=lambda commit: None) -> RunRecord:
        return cls(list(argv), os.getcwd(), cluster_path, git_state(source, on_commit=on_commit),
                   {"ddp_up": __version__, "python": platform.python_version(), "controller": platform.node()},
                   cluster_text)

    @property
    def commit(self) -> str | None:
        return self.git.commit if self.git else None

    def write(self, run_dir: str, secrets) -> None:
        """run.json, cluster.yaml (masked) and git.diff; OSError if the directory cannot take them."""
        where = own_dir(run_dir, private=True)
        cluster = self.cluster_path and os.path.abspath(self.cluster_path)
        record = {"command": self.argv, "cwd": self.cwd, "cluster_file": cluster, "versions": self.versions,
                  "git": self.git.as_dict() if self.git else None}
        _write(where, "run.json", (json.dumps(mask_values(record, secrets), indent=2) + "\n").encode())
        if cluster is not None and self.cluster_text:
            _write(where, "cluster.yaml", masked_copy(self.cluster_text, secrets).encode())
        if self.git and self.git.diff:
            diff = self.git.diff.decode("utf-8", "surrogateescape")
            _write(where, "git.diff", mask_secrets(diff, secrets).encode("utf-8", "surrogateescape"))


class RecordTaking:
    """RunRecord.take in a thread of its own, begun as the launch begins: git's calls (up to
    GIT_BUDGET, most of it in a large checkout's diff and untracked files) go on while the
    controller connects to the nodes, instead of before. The plan waits for the commit alone
    (``commit``); the run's logs write the record once it is taken (``taken``)."""

    def __init__(self, argv: list[str], cluster_path: str | None, source: str, cluster_text: str = ""):
        self.known, self.done = threading.Event(), threading.Event()
        self._commit: str | None = None
        self._record: RunRecord | None = None
        threading.Thread(target=self._take, args=(list(argv), cluster_path, source, cluster_text), name="run-record",
                         daemon=True).start()

    def _take(self, argv, cluster_path, source, cluster_text) -> None:
        # A bug here is the thread's to print (threading.excepthook): the job goes on, without a
        # record, as it does where the runs directory cannot take one (the run's logs)
        try:
            self._record = RunRecord.take(argv, cluster_path, source, cluster_text, on_commit=self._committed)
        finally:
            self.known.set()
            self.done.set()

    def _committed(self, commit: str | None) -> None:
        self._commit = commit
        self.known.set()

    @property
    def commit(self) -> str | None:
        self.known.wait(GIT_BUDGET + TAKE_SLACK)
        return self._commit

    def taken(self, block: bool = False) -> RunRecord | None:
        """The record, once taken; None while git still runs (``block``: waited for until its budget
        has passed; None then means it never ended, or failed)."""
        return self._record if self.done.wait(GIT_BUDGET + TAKE_SLACK if block else 0.0) else None


def _write(where: str, name: str, data: bytes) -> None:
    with os.fdopen(no_link_open(os.path.join(where, name), fresh=True, mode=0o600), "wb") as f:
        f.write(data)



RUNS_READ = 500  # run directories `ddp-ls` with no argument reads, newest first


def detached_here(runs_dir: str) -> dict[str, set[str]]:
    """{cluster file: {job ids}} of the detached jobs ddp-up started from here into ``runs_dir``,
    newest first, from each run's run.json (a regular file of this user's, read bounded, never
    through a link): those started with --detach from a cluster file that is still there."""
    try:
        names = sorted((n for n in os.listdir(runs_dir) if JOB_ID.fullmatch(n)), reverse=True)  # ids begin with the time
    except OSError:
        return {}
    found: dict[str, set[str]] = {}
    for name in names[:RUNS_READ]:
        data, _ = read_regular(os.path.join(runs_dir, name, "run.json"))
        try:
            record = json.loads(data) if data is not None else None
        except (ValueError, RecursionError):
            continue
        command, cluster = (record.get("command"), record.get("cluster_file")) if isinstance(record, dict) else (0, 0)
        if isinstance(command, list) and "--detach" in command and isinstance(cluster, str) and os.path.isfile(cluster):
            found.setdefault(cluster, set()).add(name)
    return found


NODES = "nodes.json"  # a job's nodes as `nodes_command:` listed them at its launch (write_nodes)
NODES_MOST = 1 << 20  # bytes of it read


def write_nodes(run_dir: str, nodes) -> None:
    """The nodes a detached job was started on, where `nodes_command:` listed them: every later
    command for that job (ddp-kill, ddp-ls, ddp-attach, ddp-logs, ddp-report) reaches these, not
    what the program lists by then (a cloud's API down, a spot pool replaced). OSError if the
    directory cannot take it."""
    entries = [{"host": n.host, "gpus": "auto" if n.gpus is None else n.gpus} for n in nodes]
    _write(own_dir(run_dir, private=True), NODES, (json.dumps(entries, indent=1) + "\n").encode())


def recorded_nodes(runs_dir: str, jobs) -> list[dict] | None:
    """The nodes the ``jobs`` recorded at their launch (write_nodes), each host once, in order; None
    where none of them has a record here (started elsewhere, or with `nodes:`)."""
    found: dict[str, dict] = {}
    any_record = False
    for job in jobs:
        if not isinstance(job, str) or not JOB_ID.fullmatch(job):
            continue
        data, _ = read_regular(os.path.join(runs_dir, job, NODES), NODES_MOST)
        try:
            entries = json.loads(data) if data is not None else None
        except (ValueError, RecursionError):
            continue
        if not isinstance(entries, list):
            continue
        any_record = True
        for entry in entries:
            if isinstance(entry, dict) and isinstance(entry.get("host"), str) and set(entry) == {"host", "gpus"}:
                found.setdefault(entry["host"], entry)
    return list(found.values()) if any_record else None
