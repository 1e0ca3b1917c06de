"""Files back from the nodes (ddp-fetch, and the `fetch:` key at a job's end): changed files only.

On every node at once, one agent call in ``fetch`` mode (node/fetch.py) over the node's own
transport: the node lists the path, this side compares the listing with what the local folder
holds (size, whole-second mtime, permission bits, link target: sync's rule), asks for the files
that differ, and writes each to a temp file beside its place, renamed into place once whole, with
the node's mtime and mode. A failed write (a full disk) removes its temp file: nothing half
written ever looks whole. Links come back as links, never followed on either side, and nothing is
written through a link already in the local folder. Nothing local is deleted.
"""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from dataclasses import dataclass, field

from ..config.cluster import NodeConfig
from ..errors import NodeProblem
from ..node import wire
from ..node.sync import link_in_parents, safe_relpath, same_file
from ..ownfiles import no_link_open
from ..plan.launch import node_workdir
from .oneshot import AgentCall
from .parallel import on_each
from .transports import transport_for

LIST_MARGIN = 60.0  # seconds for the agent to start and list the path, over the connect timeout
STALL = 60.0  # a transfer that moves no byte for this long is abandoned
QUIET = "no answer from the node agent"  # AgentCall.wait_for's words for a wait that timed out


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


def dest_for(local_dir: str, remote_path: str, label: str | None) -> str:
    """Where a node's copy goes: LOCAL_DIR/<label>/<the path's last name>, or without a label (one
    node) LOCAL_DIR/<the path's last name>, as `scp -r` and `rsync` (no trailing slash) place it."""
    name = os.path.basename(os.path.normpath(remote_path)) or "root"
    return os.path.join(local_dir, label, name) if label else os.path.join(local_dir, name)


def fetch_all(nodes: list[NodeConfig], remote_path: str, local_dir: str, per_node: bool) -> list[Fetched]:
    """Every node's copy, at once; a node's failure is its own (the others go on)."""
    return on_each(nodes, lambda n: fetch_node(n, remote_path, dest_for(local_dir, remote_path,
                                                                       n.label if per_node else None)),
                   name="fetch")


def fetch_node(node: NodeConfig, remote_path: str, dest: str) -> Fetched:
    result = Fetched(node.label, dest)
    call = FetchCall(node, wire.FetchSpec(root=node_workdir(node, os.getcwd()), path=remote_path), dest, result)
    result.problem = call.open()
    if result.problem is not None:
        return result
    try:
        call.run()
    finally:
        call.close()
    return result


class FetchCall(AgentCall):
    """The agent in fetch mode, and the local files its Chunks are written to, as they arrive (on
    the channel's reader thread: a slow disk holds the node back, never fills memory)."""

    def __init__(self, node: NodeConfig, spec: wire.FetchSpec, dest: str, result: Fetched):
        # A connection of its own: through the run's shared one, every byte would cross the
        # ControlMaster's process too (a copy more, on the CPU that decrypts).
        super().__init__(node, spec, transport_for(node, shared=False, bulk=True))
        self.dest, self.result = dest, result
        self.entries: list = []
        self.writing: dict[int, tuple[int, str]] = {}  # index -> (fd, temp path) of a file on its way
        self.failed: OSError | None = None
        self.lock = threading.Lock()

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
            self.result.problem = self.local_problem(e)
            return
        self.send(wire.Want(indices=want))
        if want:
            self.result.problem = self.wait_sent(frames)
        with self.lock:
            self.drop_partial()
        if self.failed is not None:
            self.result.problem = self.local_problem(self.failed)
            return
        if self.result.problem is not None:
            return
        sent = frames.get(wire.Sent)
        self.result.changed = [self.entries[i][0] or os.path.basename(self.dest)
                               for i in (sent.changed or () if sent else ()) if isinstance(i, int)
                               and 0 <= i < len(self.entries)]
        try:
            self.place_links()
        except OSError as e:
            self.result.problem = self.local_problem(e)

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
            path = self.path_of(rel)
            if link is None and self.unchanged(path, size, mtime_ns, mode):
                self.result.unchanged += 1
            elif link is None:
                want.append(i)
        return want

    def path_of(self, rel: str) -> str:
        """The local path of a listed entry, its folders made (never through a local link)."""
        path = os.path.join(self.dest, rel) if rel else self.dest
        where = os.path.dirname(path)
        top = os.path.dirname(self.dest)
        linked = link_in_parents(top, os.path.relpath(path, top))
        if linked is not None:
            raise OSError(errno.ELOOP, f"{linked} is a symbolic link here, and fetch never writes through one")
        os.makedirs(where, exist_ok=True)
        return path

    @staticmethod
    def unchanged(path: str, size: int, mtime_ns: int, mode: int) -> bool:
        try:
            return same_file(os.lstat(path), size, mtime_ns, mode)
        except OSError:
            return False

    def _frames(self, frames: list[wire.Frame]) -> None:
        rest = [f for f in frames if not isinstance(f, wire.Chunk)]
        for frame in frames:
            if isinstance(frame, wire.Chunk):
                self.chunk(frame)
        if rest:
            super()._frames(rest)

    def chunk(self, frame: wire.Chunk) -> None:
        with self.lock:
            if self.failed is not None or not (isinstance(frame.index, int) and 0 <= frame.index < len(self.entries)):
                return
            try:
                self.write(frame)
            except OSError as e:
                self.failed = e
                self.drop_partial()
                self.channel.close()  # the node stops sending: nothing more can be written

    def write(self, frame: wire.Chunk) -> None:
        rel, _, mtime_ns, mode, _ = self.entries[frame.index]
        if frame.index not in self.writing:
            path = self.path_of(rel)
            tmp = os.path.join(os.path.dirname(path), f".ddp-up-fetch-{os.getpid()}-{frame.index}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            self.writing[frame.index] = (fd, tmp)
        fd, tmp = self.writing[frame.index]
        view = memoryview(frame.data)
        while view:
            view = view[os.write(fd, view):]
        self.result.bytes += len(frame.data)
        if frame.end:
            del self.writing[frame.index]
            try:
                os.fchmod(fd, mode)
                os.utime(fd, ns=(mtime_ns, mtime_ns))
            finally:
                os.close(fd)
            os.replace(tmp, self.path_of(rel))
            self.result.files += 1

    def drop_partial(self) -> None:
        """Remove every temp file still being written (a failed write, a node gone mid-file)."""
        for fd, tmp in self.writing.values():
            os.close(fd)
            try:
                os.unlink(tmp)
            except OSError:
                pass
        self.writing.clear()

    def place_links(self) -> None:
        for rel, _, _, _, link in self.entries:
            if link is None:
                continue
            path = self.path_of(rel)
            try:
                if os.readlink(path) == link:
                    self.result.unchanged += 1
                    continue
            except OSError:
                pass
            if os.path.isdir(path) and not os.path.islink(path):
                self.result.left_out.append(f"{rel} (a link on the node, a folder here: kept)")
                continue
            tmp = path + f".ddp-up-fetch-{os.getpid()}"
            os.symlink(link, tmp)
            os.replace(tmp, path)
            self.result.links += 1

    def local_problem(self, e: OSError) -> NodeProblem:
        what = f"cannot write into {self.dest}: {e.strerror or e}"
        fix = {errno.ENOSPC: "free space on this machine's disk, then fetch again (what was copied stays; "
                             "no partial file is left)",
               errno.EACCES: "choose a folder you can write to"}.get(e.errno, "")
        return NodeProblem(self.node.label, what, fix)


def fetch_outputs(nodes: list[NodeConfig], paths: tuple[str, ...], run_dir: str, say) -> list[Fetched]:
    """The cluster file's `fetch:` paths, from every node of the job's last attempt, once it has
    ended (done or failed: a failed run's checkpoint is what a user wants most), into
    ``run_dir``/fetched/<node>/; what came back is recorded in ``run_dir``/fetched.json."""
    into = os.path.join(run_dir, "fetched")
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
