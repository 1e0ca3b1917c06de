"""Run the node agent once in a one-shot mode (detect, sweep, sync) and collect its frames.

The same channel, bootstrap and frames as a launch; the agent answers and exits.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

from ..config.cluster import NodeConfig
from ..errors import NodeProblem
from ..node.protocol import wire
from .channel import AgentChannel, ChannelEnd
from .transport import ConnectFailed, Transport
from .transports import transport_for


@dataclass
class Reply:
    node: NodeConfig
    frames: dict[type, wire.Frame] = field(default_factory=dict)  # the last frame of each kind
    problem: NodeProblem | None = None  # could not connect, or no complete answer
    reached: bool = False  # the node's shell ran the agent: a problem is the node's (no python), not its link's

    @property
    def error(self) -> str | None:
        return self.problem.what if self.problem else None


class AgentCall:
    """A one-shot agent to talk with: ``send``/``write`` to it, ``wait_for`` a frame, every wait
    bounded. The hello goes out on the channel's writer thread, so a node that takes the
    connection but never reads cannot block the caller. Without ``spec``, the first ``send``
    must be it (sync connects while it scans its tree)."""

    def __init__(self, node: NodeConfig, spec: wire.Frame | None, transport: Transport | None = None, setup: bool = False,
                 mode: type | None = None, tags: dict[str, str] | None = None):
        self.node = node
        self.end: ChannelEnd | None = None  # how the agent's output ended, once it has
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        # With setup, the node's `setup:` runs first, in its workdir: for questions about the job's environment.
        self.channel = AgentChannel(node, transport or transport_for(node), spec, self._frames, self._inbox.put,
                                    setup=node.setup if setup else (), workdir=node.workdir if setup else None, mode=mode,
                                    tags=tags)

    def open(self) -> NodeProblem | None:
        """Connect and start the agent; the reason if that failed."""
        try:
            self.channel.open()
        except ConnectFailed as e:
            return e.problem
        return None

    def _frames(self, frames: list[wire.Frame]) -> None:
        for frame in frames:
            if not isinstance(frame, (wire.Heartbeat, wire.Output)):
                self._inbox.put(frame)

    def wait_for(self, want: type, limit: float, frames: dict[type, wire.Frame]) -> NodeProblem | None:
        """Collect frames into ``frames`` (the last of each kind) until a ``want``; the problem
        instead if the agent reports Failed, ends, or says nothing for ``limit`` seconds."""
        deadline = time.monotonic() + limit
        while True:
            try:
                item = self._inbox.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return NodeProblem(self.node.label, f"no answer from the node agent within {limit:.0f} s")
            if isinstance(item, ChannelEnd):
                self._inbox.put(item)  # every later wait sees the end too
                self.end = item
                return item.problem(self.node, f"without {want.__name__}")
            frames[type(item)] = item
            if isinstance(item, want):
                return None
            if isinstance(item, wire.Failed):
                return NodeProblem(self.node.label, item.what, item.fix)

    @property
    def reached(self) -> bool:
        """Whether the node ran the agent: it spoke, or ended with a status of its own (not ssh's
        255 for "could not connect")."""
        return self.channel.heard or (self.end is not None and self.end.exit_status not in (None, 255))

    def send(self, frame: wire.Frame) -> None:
        self.channel.send(frame)

    def write(self, data: bytes) -> None:
        self.channel.write(data)

    def close(self) -> None:
        """Idempotent; also how another thread aborts a call (blocked reads and writes fail)."""
        self.channel.close()
        self.channel.transport.close()

    def abort(self) -> None:
        """From another thread, at once: the process here ends first (ssh, still connecting or
        not), so that the call's own writer, blocked on its stdin, fails instead of holding it."""
        proc = self.channel.proc
        if proc is not None:
            proc.terminate()
        self.close()


class Calls:
    """The calls under way, for another thread to cut short (``cut``: their connections closed,
    their ssh processes ended); a call begun after a cut goes on, bounded as every call is."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._under_way: set[AgentCall] = set()

    def add(self, call: AgentCall) -> None:
        with self._lock:
            self._under_way.add(call)

    def discard(self, call: AgentCall) -> None:
        with self._lock:
            self._under_way.discard(call)

    def cut(self) -> None:
        with self._lock:
            calls = list(self._under_way)
        for call in calls:
            call.abort()


def call_agent(node: NodeConfig, spec: wire.Frame, limit: float, until: type,
               transport: Transport | None = None, setup: bool = False, calls: Calls | None = None) -> Reply:
    """Send ``spec`` and collect frames until an ``until`` frame; bounded by ``limit`` seconds.
    ``calls``: where the call is kept while under way, for another thread to cut it short."""
    reply = Reply(node)
    call = AgentCall(node, spec, transport, setup)
    if calls is not None:
        calls.add(call)
    try:
        reply.problem = call.open()
        if reply.problem is None:
            reply.problem = call.wait_for(until, limit, reply.frames)
        reply.reached = call.reached
    finally:
        call.close()
        if calls is not None:
            calls.discard(call)
    return reply
