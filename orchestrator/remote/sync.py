"""Workdir sync: copy a local directory to every node's workdir before launch, changed files only.

The tree is scanned once here, honoring .gitignore files as git does (each applies below its own
directory, deeper ones win, ``.git/info/exclude`` lowest) plus the `exclude:` patterns (highest),
via ``pathspec``. Then, on every node at once, one agent call in ``sync`` mode: the node says
which entries differ from its copy (missing, size, whole-second mtime, permission bits, link
target) and receives only those, each written to a temp file and renamed into place. Nodes
whose workdirs turn out to be one directory (each finds the other's marker file: an NFS home)
get one copy between them. It runs over the node's own transport, so SSH config, ProxyJump and
host-key checks are the launch's. Nothing on a node is ever deleted: outputs and checkpoints in
the workdir stay.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from rich.filesize import decimal as human_bytes

from ..config.cluster import SyncConfig
from ..errors import ConfigError, NodeProblem, SetupError, UsageError
from ..node.protocol import wire
from ..plan.launch import LaunchPlan, NodePlan
from .oneshot import AgentCall
from .parallel import on_each

CHUNK = 1 << 20
ANSWER_MARGIN = 60.0  # seconds for the agent to start and stat the tree, over the connect timeout
STALL = 60.0  # a transfer that moves no byte for this long is abandoned


# --- the local tree -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Entry:
    path: str  # relative to the tree's root, "/"-separated
    size: int
    mtime_ns: int
    mode: int  # permission bits
    link: str | None = None  # a symlink's target (copied as a link, as git and rsync -a do)

    def wire(self) -> list:
        return [self.path, self.size, self.mtime_ns, self.mode, self.link]


@dataclass(frozen=True)
class Tree:
    root: str
    entries: tuple[Entry, ...]

    @property
    def size(self) -> int:
        return sum(e.size for e in self.entries if e.link is None)


class IgnoreRules:
    """Whether a path is left out: `exclude:` first, then the nearest .gitignore that matches it."""

    def __init__(self, root: str, exclude: Iterable[str], gitignore: bool):
        import pathspec

        self._spec = pathspec.GitIgnoreSpec.from_lines
        self.root = root
        self.gitignore = gitignore
        self.exclude = self._spec(list(exclude))
        self.by_dir: dict[str, object] = {}  # "" is the root; "a/b" a subdirectory
        self.info = self._spec(_read_lines(os.path.join(root, ".git", "info", "exclude"))) if gitignore else None

    def enter(self, rel_dir: str) -> None:
        """Read the .gitignore of a directory as the walk reaches it."""
        if self.gitignore:
            lines = _read_lines(os.path.join(self.root, rel_dir, ".gitignore"))
            if lines:
                self.by_dir[rel_dir] = self._spec(lines)

    def ignored(self, rel: str, is_dir: bool) -> bool:
        if rel == ".git" or rel.startswith(".git/"):
            return True
        name = rel + "/" if is_dir else rel
        verdict = self.exclude.check_file(name).include
        if verdict is not None:
            return verdict
        for base in _ancestors(rel):
            spec = self.by_dir.get(base)
            if spec is not None:
                verdict = spec.check_file(name[len(base) + 1:] if base else name).include
                if verdict is not None:
                    return verdict
        return bool(self.info is not None and self.info.check_file(name).include)


def _ancestors(rel: str) -> list[str]:
    """The directories above ``rel``, deepest first, ending with the root ""."""
    parts = rel.split("/")[:-1]
    return ["/".join(parts[:i]) for i in range(len(parts), -1, -1)]


def _read_lines(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            return f.read().splitlines()
    except OSError:
        return []


def scan(sync: SyncConfig, skip: Iterable[str] = ()) -> Tree:
    """Every file and symlink under ``sync.src`` that is not ignored; ``skip`` names absolute
    directories to leave out as well (ddp-up's own runs directory)."""
    root = sync.src
    skipped = {os.path.realpath(p) for p in skip}
    rules = IgnoreRules(root, sync.exclude, sync.gitignore)
    entries = []
    for here, dirs, files in os.walk(root, onerror=_unreadable):
        rel_dir = os.path.relpath(here, root).replace(os.sep, "/")
        rel_dir = "" if rel_dir == "." else rel_dir
        rules.enter(rel_dir)
        kept = []
        for name in sorted(dirs):
            rel = f"{rel_dir}/{name}" if rel_dir else name
            full = os.path.join(here, name)
            if rules.ignored(rel, is_dir=True) or os.path.realpath(full) in skipped:
                continue
            if os.path.islink(full):  # a link to a directory: copied as the link, not followed
                entries.append(_entry(full, rel))
            else:
                kept.append(name)
        dirs[:] = kept
        for name in sorted(files):
            rel = f"{rel_dir}/{name}" if rel_dir else name
            if not rules.ignored(rel, is_dir=False):
                entries.append(_entry(os.path.join(here, name), rel))
    return Tree(root, tuple(e for e in entries if e is not None))


def _unreadable(e: OSError) -> None:
    """A directory the copy cannot read is an error, not a silent gap in the nodes' workdirs."""
    raise UsageError(f"sync: cannot read {e.filename}: {e.strerror}; fix its permissions or add it to "
                     "`sync.exclude`")


def _entry(full: str, rel: str) -> Entry | None:
    try:
        st = os.lstat(full)
        if stat.S_ISLNK(st.st_mode):
            return Entry(rel, 0, st.st_mtime_ns, 0o777, link=os.readlink(full))
    except OSError:
        return None  # gone while we looked
    if not stat.S_ISREG(st.st_mode):
        return None  # sockets, fifos, devices
    return Entry(rel, st.st_size, st.st_mtime_ns, stat.S_IMODE(st.st_mode))


# --- one node -----------------------------------------------------------------------------------

@dataclass
class NodeSync:
    """One node's copy: ``offer`` (what differs there), then ``send`` (just that)."""

    node: NodePlan
    dest: str
    idle_timeout: float  # the node gives up on a controller silent this long (see targets)
    tree: Tree | None = None  # known once scanned (the node connects meanwhile)
    need: list[int] = field(default_factory=list)
    marker: str = ""  # the file this node's agent keeps in its workdir while it works
    sees: frozenset[str] = frozenset()  # the other nodes' markers found in this node's workdir
    shares_with: NodeSync | None = None  # an earlier node with the same workdir (NFS): it copies
    files: int = 0
    bytes: int = 0
    problem: NodeProblem | None = None

    def __post_init__(self) -> None:
        self.call = AgentCall(self.node.config, None, mode=wire.SyncSpec)  # the spec (the tree's entries) follows the scan
        self.moved = 0.0  # last time bytes went out (the stall watchdog reads it)
        self.sent = threading.Event()  # ends the watchdog

    @property
    def label(self) -> str:
        return self.node.label

    @property
    def need_bytes(self) -> int:
        return sum(self.tree.entries[i].size for i in self.need)

    def fail(self, what: str, fix: str = "") -> None:
        if self.problem is None:
            self.problem = NodeProblem(self.label, what, fix)

    def offer(self, scanned: Scanned) -> None:
        """Connect and start the agent while the tree is scanned here, then send the tree's
        entries: the node's answer is which of them differ there. A failed scan sends nothing."""
        self.problem = self.call.open()
        if self.problem is not None:
            return
        self.tree = scanned.wait()
        if self.tree is None:
            return
        self.call.send(wire.SyncSpec(dest=self.dest, entries=[e.wire() for e in self.tree.entries],
                                     idle_timeout=self.idle_timeout))
        limit = self.node.config.ssh.connect_timeout + ANSWER_MARGIN
        needs = self._answer(limit, wire.Needs)
        if needs is not None:
            self.need, self.marker = list(needs.need), needs.marker

    def ask_sharing(self, markers: list[str]) -> None:
        """Which of the other nodes' markers are in this node's workdir (a shared filesystem)."""
        self.call.send(wire.AskShared(markers=markers))
        shared = self._answer(ANSWER_MARGIN, wire.Shared)
        if shared is not None:
            self.sees = frozenset(shared.sees)

    def send(self, advance: Callable[[int], None]) -> None:
        """Every needed file, then EndOfFiles; the node creates the needed links and reports."""
        if self.problem is not None:
            return
        self.moved = time.monotonic()
        threading.Thread(target=self._watch, name=f"{self.label}-sync-watch", daemon=True).start()
        out = _Outbox(self, advance)
        try:
            for i in self.need:
                entry = self.tree.entries[i]
                if entry.link is None:
                    self._send_file(i, entry, out)
            out.put(wire.EndOfFiles().encode())
            out.flush()
        except LocalChanged as e:
            self.fail(str(e), "let the writer finish, then run again")
            self.call.close()  # the node sees the end mid-file and drops it
            return
        except OSError:
            pass  # the node closed; its F frame (read below) or the lost connection says why
        finally:
            self.sent.set()
        copied = self._answer(ANSWER_MARGIN, wire.Copied)
        if copied is not None:
            self.files, self.bytes = copied.files, copied.bytes

    def _send_file(self, index: int, entry: Entry, out: _Outbox) -> None:
        path = os.path.join(self.tree.root, entry.path)
        try:
            f = open(path, "rb")
        except OSError as e:
            raise LocalChanged(f"cannot read {path}: {e.strerror}") from None
        with f:
            st = os.fstat(f.fileno())
            out.put(wire.File(index=index, size=st.st_size, mtime_ns=st.st_mtime_ns).encode())
            out.put_file(f, st.st_size, path)

    def _answer(self, limit: float, want: type) -> wire.Frame | None:
        """The agent's ``want`` report, or None with the failure recorded as the node's problem."""
        frames: dict[type, wire.Frame] = {}
        problem = self.call.wait_for(want, limit, frames)
        if problem is not None:
            self.problem = self.problem or problem  # the first reason is the one that explains
            return None
        return frames[want]

    def _watch(self) -> None:
        while not self.sent.wait(1.0):
            if time.monotonic() - self.moved > STALL:
                self.fail(f"the copy made no progress for {STALL:.0f} s", "check the network path and the node's disk")
                self.call.close()  # unblocks the sender
                return

    def abort(self) -> None:
        self.call.close()


class LocalChanged(Exception):
    pass


class _Outbox:
    """Gathers headers and small files into writes of about CHUNK bytes: a source tree is mostly
    small files, and two SSH writes per file cost more than the bytes. A large file goes out
    from one reused buffer, never copied again on the way."""

    def __init__(self, sync: NodeSync, advance: Callable[[int], None]):
        self.sync = sync
        self.advance = advance
        self.buf = bytearray()
        self.payload = 0  # file bytes in buf (what the progress bar counts)
        self.chunk = memoryview(bytearray(CHUNK))

    def put(self, data: bytes, payload: int = 0) -> None:
        self.buf += data
        self.payload += payload
        if len(self.buf) >= CHUNK:
            self.flush()

    def put_file(self, f, size: int, path: str) -> None:
        """``size`` bytes of the open file ``f``; LocalChanged if it has fewer."""
        if len(self.buf) + size <= CHUNK:
            data = f.read(size)
            if len(data) < size:
                raise LocalChanged(f"{path} shrank while it was being copied")
            self.put(data, size)
            return
        self.flush()
        left = size
        while left:
            n = f.readinto(self.chunk[:min(left, CHUNK)])
            if not n:
                raise LocalChanged(f"{path} shrank while it was being copied")
            self._write(self.chunk[:n], n)
            left -= n

    def flush(self) -> None:
        if self.buf:
            self._write(self.buf, self.payload)
            self.buf, self.payload = bytearray(), 0

    def _write(self, data, payload: int) -> None:
        self.sync.call.write(data)
        self.sync.moved = time.monotonic()
        self.advance(payload)


# --- every node ---------------------------------------------------------------------------------

@dataclass
class SyncSummary:
    tree: Tree
    nodes: list[NodeSync]
    seconds: float

    def render(self) -> str:
        where = f"sync {self.tree.root} -> workdir, {len(self.tree.entries):,} files"
        if not self.nodes:
            return f"sync {self.tree.root}: every node's workdir is this directory; nothing to copy"
        copied = [n for n in self.nodes if n.need]
        if not copied:
            return f"{where}: nothing to copy, all unchanged on {len(self.nodes)} node(s) ({self.seconds:.1f} s)"
        if len({(n.files, n.bytes) for n in copied}) == 1:
            what = f"{copied[0].files:,} file(s) ({human_bytes(copied[0].bytes)}) to each of {len(copied)} node(s)"
        else:
            total = human_bytes(sum(n.bytes for n in copied))
            what = f"{sum(n.files for n in copied):,} file(s) ({total} in all) to {len(copied)} node(s)"
        shared = sum(1 for n in self.nodes if n.shares_with is not None)
        fresh = len(self.nodes) - len(copied) - shared
        return (f"{where}: copied {what}" + (f", {fresh} up to date" if fresh else "")
                + (f"; {shared} more share a workdir with one of those" if shared else "")
                + f" ({self.seconds:.1f} s)")


def targets(plan: LaunchPlan, src: str, config_path: str) -> list[NodeSync]:
    """A NodeSync per node that needs the copy: each needs a workdir; a local node whose workdir
    is the source (the demo's default) needs nothing, and local nodes sharing one get one copy."""
    # A node may legitimately hear nothing while the slowest other node answers, and then during a
    # stalled transfer; silent longer, the controller is gone and the node's agent exits.
    idle = max(n.config.ssh.connect_timeout for n in plan.nodes) + ANSWER_MARGIN + STALL
    found, local_dests = [], set()
    for node in plan.nodes:
        if node.workdir is None:
            raise ConfigError(config_path, node.config.line, f"nodes[{node.index}]",
                              f"sync copies into each node's `workdir:`, and {node.label} has none; "
                              "set `workdir:` (top level or on the node), e.g. ~/project")
        if node.config.transport == "local":
            dest = os.path.realpath(os.path.expanduser(node.workdir))
            if dest == os.path.realpath(src) or dest in local_dests:
                continue
            local_dests.add(dest)
        found.append(NodeSync(node, node.workdir, idle))
    return found


class Scanned:
    """The local tree, scanned while the nodes connect: each node's call waits here for it."""

    def __init__(self, scan_tree: Callable[[], Tree]):
        self._scan_tree = scan_tree
        self._done = threading.Event()
        self.tree: Tree | None = None  # None after a failed scan (its error is raised by sync_all)

    def run(self) -> None:
        try:
            self.tree = self._scan_tree()
        finally:
            self._done.set()

    def wait(self) -> Tree | None:
        self._done.wait()
        return self.tree


def sync_all(scan_tree: Callable[[], Tree], syncs: list[NodeSync], progress) -> SyncSummary:
    """Scan the tree while every node connects and starts its agent (the connection is most of a
    small copy's time), ask every node what differs, then send it, all nodes at once. The scan's
    own error (UsageError) or SetupError naming each node that failed; nothing has been started
    anywhere."""
    started = time.monotonic()
    scanned = Scanned(scan_tree)
    try:
        _each([None, *syncs], lambda s: scanned.run() if s is None else s.offer(scanned))
        _raise_problems(syncs)
        if len(syncs) > 1:
            _each(syncs, lambda s: s.ask_sharing([o.marker for o in syncs if o is not s]))
            _raise_problems(syncs)
            share_workdirs(syncs)
        with progress(sum(s.need_bytes for s in syncs), len([s for s in syncs if s.need])) as advance:
            _each(syncs, lambda s: s.send(advance))
        _raise_problems(syncs)
    finally:
        for s in syncs:
            s.abort()
    return SyncSummary(scanned.tree, syncs, time.monotonic() - started)


def share_workdirs(syncs: list[NodeSync]) -> None:
    """Nodes whose workdir is one directory (a shared filesystem: one found the other's marker)
    get one copy, from the first of them; the rest are sent nothing. Markers only ever show a
    real share, so a missed one (NFS caches lookups) means a redundant copy, never a lost one."""
    for i, node in enumerate(syncs):
        for earlier in syncs[:i]:
            if earlier.marker in node.sees or node.marker in earlier.sees:
                node.shares_with = earlier.shares_with or earlier
                node.need = []
                break


def _raise_problems(syncs: list[NodeSync]) -> None:
    problems = [s.problem for s in syncs if s.problem is not None]
    if problems:
        raise SetupError(problems)


def _each(syncs: list, step: Callable) -> None:
    """``step`` on every item at once; on a signal every call is closed first, so no thread is
    left blocked on a transfer (the nodes see EOF and drop their partial files)."""
    def abort() -> None:
        for s in syncs:
            if s is not None:
                s.abort()

    on_each(syncs, step, abort=abort, name="sync")
