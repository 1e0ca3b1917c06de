"""Files back from the nodes (ddp-fetch, and the `fetch:` key at a job's end): changed files only.

On every node at once, one agent call in ``fetch`` mode (node/files/fetch.py) over the node's own
transport: the node lists the path, this side compares the listing with what the local folder
holds (size, whole-second mtime, permission bits, link target: sync's rule), asks for the files
that differ, and writes each to a temp file beside its place, renamed into place once whole, with
the node's mtime and mode. A failed write (a full disk) removes its temp file, and so does a
stop (Ctrl-C): nothing half written ever looks whole. Links come back as links, never followed on
either side, and nothing is written through a link in the local folder (landing.py). Every byte
lands at or under LOCAL_DIR/<node>/<name>, both names made safe by ddp-up and distinct for every
node. Nothing local is deleted.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from ..config.cluster import NodeConfig, node_workdir
from ..errors import NodeProblem, UsageError
from ..node.protocol import wire
from ..node.files.fetch import CHUNK
from ..node.files.sync import safe_relpath, same_file
from ..ownfiles import NO_NAME_OF_ITS_OWN, fetch_name, no_link_open, own_dir, safe_name
from .landing import Landing, unlink_quietly
from .oneshot import AgentCall
from .parallel import on_each
from .transports import transport_for

LIST_MARGIN = 60.0  # seconds for the agent to start and list the path, over the connect timeout
STALL = 60.0  # a transfer that moves no byte for this long is abandoned
QUIET = "no answer from the node agent"  # AgentCall.wait_for's words for a wait that timed out
ZEROS = bytes(CHUNK)  # a whole Chunk of these is a hole, not bytes to write


@dataclass
class Fetched:
    """One node's fetch, as ddp-fetch reports it and the run record keeps it."""

    node: str
    dest: str
    files: int = 0  # files copied (changed or new)
    bytes: int = 0
    unchanged: int = 0  # files already here, as the node has them
    links: int = 0
    left_out: list[str] = field(default_factory=list)  # on the node: not a file or link, or unreadable
    changed: list[str] = field(default_factory=list)  # changed on the node while sent: fetch again
    problem: NodeProblem | None = None

    def as_dict(self) -> dict:
        return {"node": self.node, "dest": self.dest, "files": self.files, "bytes": self.bytes,
                "unchanged": self.unchanged, "links": self.links, "left_out": self.left_out,
                "changed": self.changed, "error": self.problem.render() if self.problem else None}


def fetch_folders(nodes: list[NodeConfig]) -> dict[int, str]:
    """Each node's folder under LOCAL_DIR: its label made safe (a label is a host, and
    ``transport: local`` takes any text); where two nodes would share one (one host twice, on two
    ports or two transports), each of them gets its rank too. Refused if they still meet."""
    names = {n.rank: safe_name(n.label) for n in nodes}
    shared = Counter(names.values())
    names = {rank: f"{name}-node{rank}" if shared[name] > 1 else name for rank, name in names.items()}
    if len(set(names.values())) < len(names):
        raise UsageError("two nodes' copies would land in one folder: give the nodes distinct hosts or fetch "
                         "with --node, one at a time")
    return names


def landing_parts(remote_path: str, folder: str | None) -> tuple[str, ...]:
    """The parts below LOCAL_DIR where a node's copy goes: <node>/<name>, or without a node's
    folder (one node) <name>, as `scp -r` and `rsync` (no trailing slash) name it."""
    name = fetch_name(remote_path)
    if name is None:
        raise UsageError(f"{remote_path!r} {NO_NAME_OF_ITS_OWN}")
    return (folder, name) if folder else (name,)


def destinations(nodes: list[NodeConfig], remote_path: str, per_node: bool) -> dict[int, tuple[str, ...]]:
    """Each node's parts below LOCAL_DIR, every one distinct; UsageError before anything is copied."""
    folders = fetch_folders(nodes) if per_node else {}
    return {n.rank: landing_parts(remote_path, folders.get(n.rank)) for n in nodes}


def fetch_all(nodes: list[NodeConfig], remote_path: str, local_dir: str, per_node: bool) -> list[Fetched]:
    """Every node's copy, at once; a node's failure is its own (the others go on). On a signal,
    every copy is stopped and its unfinished files removed before Interrupted is raised."""
    where = destinations(nodes, remote_path, per_node)
    calls = [FetchCall(n, remote_path, local_dir, where[n.rank]) for n in nodes]
    return on_each(calls, FetchCall.fetch, abort=lambda: [call.abort() for call in calls], name="fetch")


class FetchCall(AgentCall):
    """The agent in fetch mode, and the local files its Chunks are written to, as they arrive (on
    the channel's reader thread: a slow disk holds the node back, never fills memory)."""

    def __init__(self, node: NodeConfig, remote_path: str, local_dir: str, under: tuple[str, ...]):
        # A connection of its own: through the run's shared one, every byte would cross the
        # ControlMaster's process too (a copy more, on the CPU that decrypts).
        spec = wire.FetchSpec(root=node_workdir(node, os.getcwd()), path=remote_path)
        super().__init__(node, spec, transport_for(node, shared=False, bulk=True))
        self.local_dir, self.under = local_dir, under
        self.result = Fetched(node.label, os.path.join(local_dir, *under))
        self.landing: Landing | None = None
        self.entries: list = []
        self.writing: dict[int, tuple[int, int, str]] = {}  # index -> (fd, folder fd, temp name) of a file on its way
        self.failed: tuple[str, OSError] | None = None  # (the file, why) of a write that failed
        self.stopped = False  # aborted, or over: no byte is written any more
        self.lock = threading.Lock()

    def fetch(self) -> Fetched:
        """Connect, list, copy: the node's result (its problem, if any, in it)."""
        try:
            self.landing = Landing(self.local_dir, self.under)
        except OSError as e:
            self.result.problem = self.local_problem("", e)
            return self.result
        try:
            self.result.problem = self.open()
            if self.result.problem is None and not self.stopped:
                self.run()
        finally:
            self.close()
            with self.lock:
                self.stopped = True
                self.drop_partial()
                self.landing.close()
        return self.result

    def abort(self) -> None:
        """Stop this copy from any thread: no byte is written after this returns, and every file
        still on its way is removed (what arrived whole stays)."""
        with self.lock:
            self.stopped = True
            self.drop_partial()
        self.close()

    def run(self) -> None:
        frames: dict[type, wire.Frame] = {}
        self.result.problem = self.wait_for(wire.Listing, self.node.ssh.connect_timeout + LIST_MARGIN, frames)
        if self.result.problem is not None:
            return
        listing = frames[wire.Listing]
        self.entries = listing.entries if isinstance(listing.entries, list) else []
        self.result.left_out = [str(x) for x in listing.left_out or ()]
        try:
            want = self.plan()
        except OSError as e:
            self.result.problem = self.local_problem("", e)
            return
        self.send(wire.Want(indices=want))
        if want:
            self.result.problem = self.wait_sent(frames)
        with self.lock:
            self.drop_partial()
        if self.failed is not None:
            self.result.problem = self.local_problem(*self.failed)
            return
        if self.result.problem is not None:
            return
        sent = frames.get(wire.Sent)
        self.result.changed = [self.entries[i][0] or self.under[-1]
                               for i in (sent.changed or () if sent else ()) if isinstance(i, int)
                               and 0 <= i < len(self.entries)]
        self.place_links()

    def wait_sent(self, frames: dict) -> NodeProblem | None:
        """Until Sent, as long as bytes keep coming (a large file takes long; a stalled one, STALL)."""
        moved, last = self.result.bytes, time.monotonic()
        while True:
            problem = self.wait_for(wire.Sent, 2.0, frames)
            if problem is None or self.failed is not None or not problem.what.startswith(QUIET):
                return problem  # Sent, or the node's failure or end
            if self.result.bytes != moved:
                moved, last = self.result.bytes, time.monotonic()
            elif time.monotonic() - last > STALL:
                return NodeProblem(self.node.label, f"no byte from the node for {STALL:.0f} s: the copy was abandoned")

    def plan(self) -> list[int]:
        """The indices of the files to send: those that differ here. Refuses a listing with a path
        out of the folder, or a local link in the way (writes never go through one)."""
        want = []
        for i, entry in enumerate(self.entries):
            rel, size, mtime_ns, mode, link = entry
            if rel and not safe_relpath(rel):
                raise OSError(errno.EINVAL, f"the node listed {rel!r}, a path out of the folder")
            st = self.landing.lstat(rel)
            if link is None and st is not None and same_file(st, size, mtime_ns, mode):
                self.result.unchanged += 1
            elif link is None:
                want.append(i)
        return want

    def _frames(self, frames: list[wire.Frame]) -> None:
        rest = [f for f in frames if not isinstance(f, wire.Chunk)]
        for frame in frames:
            if isinstance(frame, wire.Chunk):
                self.chunk(frame)
        if rest:
            super()._frames(rest)

    def chunk(self, frame: wire.Chunk) -> None:
        with self.lock:
            if self.failed is not None or self.stopped or not (
                    isinstance(frame.index, int) and 0 <= frame.index < len(self.entries)):
                return
            try:
                self.write(frame)
            except OSError as e:
                self.failed = (self.entries[frame.index][0], e)
                self.drop_partial()
                self.channel.close()  # the node stops sending: nothing more can be written

    def write(self, frame: wire.Chunk) -> None:
        rel, _, mtime_ns, mode, _ = self.entries[frame.index]
        if frame.index not in self.writing:
            self.writing[frame.index] = self.landing.temp_file(rel, frame.index)
        fd, folder, temp = self.writing[frame.index]
        write_keeping_holes(fd, frame.data)
        self.result.bytes += len(frame.data)
        if frame.end:
            del self.writing[frame.index]
            try:
                os.ftruncate(fd, os.lseek(fd, 0, os.SEEK_CUR))  # a hole at the end is a size, not bytes
                os.fchmod(fd, mode)
                os.utime(fd, ns=(mtime_ns, mtime_ns))
                os.close(fd)
                self.landing.place(folder, temp, rel)
            except OSError:
                unlink_quietly(temp, folder)
                raise
            finally:
                os.close(folder)
            self.result.files += 1

    def drop_partial(self) -> None:
        """Remove every temp file still being written (a failed write, a node gone mid-file, a stop)."""
        for fd, folder, temp in self.writing.values():
            os.close(fd)
            unlink_quietly(temp, folder)
            os.close(folder)
        self.writing.clear()

    def place_links(self) -> None:
        for index, (rel, _, _, _, link) in enumerate(self.entries):
            if link is None:
                continue
            with self.lock:
                if self.stopped:
                    return
                try:
                    self.place_link(index, rel, link)
                except OSError as e:
                    self.result.problem = self.local_problem(rel, e)
                    return

    def place_link(self, index: int, rel: str, link: str) -> None:
        st = self.landing.lstat(rel)
        if st is not None and stat.S_ISLNK(st.st_mode) and self.landing.readlink(rel) == link:
            self.result.unchanged += 1
        elif st is not None and stat.S_ISDIR(st.st_mode):
            self.result.left_out.append(f"{rel or self.under[-1]} (a link on the node, a folder here: kept)")
        else:
            self.landing.link(rel, link, index)
            self.result.links += 1

    def local_problem(self, rel: str, e: OSError) -> NodeProblem:
        where = self.landing.shown(rel) if self.landing else self.result.dest
        what = f"cannot write {where}: {e.strerror or e}"
        fix = {errno.ENOSPC: "free space on this machine's disk, then fetch again (what was copied stays; "
                             "no partial file is left)",
               errno.EACCES: "choose a folder you can write to"}.get(e.errno, "")
        return NodeProblem(self.node.label, what, fix)


def write_keeping_holes(fd: int, data: bytes) -> None:
    """``data`` at the file's position; a chunk of zeros is skipped over instead (a sparse file
    keeps its holes where this file system allows, as `rsync --sparse` does)."""
    if data and data == ZEROS[:len(data)]:  # bytes to bytes: a memcmp (a whole chunk's slice is ZEROS itself)
        os.lseek(fd, len(data), os.SEEK_CUR)
        return
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def fetch_outputs(nodes: list[NodeConfig], paths: tuple[str, ...], run_dir: str, say) -> list[Fetched]:
    """The cluster file's `fetch:` paths, from every node of the job's last attempt, once it has
    ended (done or failed: a failed run's checkpoint is what a user wants most), into
    ``run_dir``/fetched/<node>/; what came back is recorded in ``run_dir``/fetched.json."""
    into = os.path.join(run_dir, "fetched")
    try:
        own_dir(into)
    except OSError as e:
        say(f"cannot fetch {', '.join(paths)}: cannot make {into} ({e.strerror or e})")
        return []
    fetched = [f for path in paths for f in fetch_all(nodes, path, into, per_node=True)]
    record = json.dumps([f.as_dict() for f in fetched], indent=1)
    try:
        with os.fdopen(no_link_open(os.path.join(run_dir, "fetched.json"), fresh=True), "w") as out:
            out.write(record + "\n")
    except OSError as e:
        say(f"cannot record what was fetched in {run_dir} ({e.strerror or e})")
    done = [f for f in fetched if f.problem is None]
    say(f"fetched {', '.join(paths)} from {len({f.node for f in done})} node(s) into {into}/: "
        f"{sum(f.files for f in done)} file(s) copied, {sum(f.unchanged for f in done)} unchanged")
    for f in fetched:
        if f.problem is not None:
            say(f"cannot fetch from {f.problem.render()}")
    return fetched
