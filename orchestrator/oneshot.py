"""Run the node agent once in a one-shot mode (``sweep``, ``detect``, ``sync``) and collect its frames.

The same connection, bootstrap and framing as a launch; the agent answers and exits.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, TypeVar

from . import protocol
from .config import NodeConfig
from .errors import NodeProblem
from .transport import ConnectFailed, Transport, early_exit_problem, transport_for

T = TypeVar("T")


@dataclass
class Reply:
    node: NodeConfig
    frames: dict[bytes, dict] = field(default_factory=dict)  # the last JSON frame of each kind
    problem: NodeProblem | None = None  # could not connect, or no complete answer

    @property
    def error(self) -> str | None:
        return self.problem.what if self.problem else None


class AgentCall:
    """A one-shot agent to talk with: ``write`` to it, ``next`` frame from it, every wait bounded.

    The hello goes out on the reader thread, so a node that takes the connection but never
    reads cannot block the caller; the caller's waits are all ``next(timeout)``.
    """

    TIMEOUT = (b"", None)  # ``next`` found nothing in time
    END = (b"", b"")  # the agent's stdout closed

    def __init__(self, node: NodeConfig, spec: dict, transport: Transport | None = None, setup: bool = False):
        self.node = node
        self.spec = spec
        self.transport = transport or transport_for(node)
        self.setup = setup  # run the node's `setup:` first (for questions about the job's environment)
        self.proc = None
        self._frames: queue.SimpleQueue = queue.SimpleQueue()
        self._stderr: deque[str] = deque(maxlen=20)
        self._stderr_done = threading.Event()

    def open(self) -> NodeProblem | None:
        """Connect and start the agent; the reason if that failed."""
        setup, workdir = (self.node.setup, self.node.workdir) if self.setup else ((), None)
        try:
            self.transport.connect()
            self.proc = self.transport.start(self.node.python, protocol.bootstrap_args(), {}, setup, workdir)
        except ConnectFailed as e:
            return e.problem
        threading.Thread(target=self._read, name=f"{self.node.label}-oneshot", daemon=True).start()
        threading.Thread(target=self._read_stderr, name=f"{self.node.label}-oneshot-err", daemon=True).start()
        return None

    def ended(self, what: str) -> NodeProblem:
        """Why the agent's output ended before ``what``: a failed setup command, no such python,
        or its exit status and last words."""
        status = self.exit_status()
        self._stderr_done.wait(1.0)
        if status:
            return early_exit_problem(self.node, status, tuple(self._stderr))
        return NodeProblem(self.node.label, f"the agent ended {what} (exit status {status})")

    def wait_for(self, want: bytes, limit: float, frames: dict[bytes, dict]) -> NodeProblem | None:
        """Read frames into ``frames`` (the last of each kind) until ``want``; the problem instead
        if the agent reports a failure (``F``), ends, or says nothing for ``limit`` seconds."""
        deadline = time.monotonic() + limit
        while True:
            frame = self.next(deadline - time.monotonic())
            if frame is self.TIMEOUT:
                return NodeProblem(self.node.label, f"no answer from the node agent within {limit:.0f} s")
            if frame is self.END:
                return self.ended("without an answer")
            kind, data = frame[0], protocol.decode_json(frame[1])
            frames[kind] = data
            if kind == want:
                return None
            if kind == b"F":
                return NodeProblem(self.node.label, data.get("what", "the node agent failed"), data.get("fix", ""))

    def next(self, timeout: float) -> tuple[bytes, object]:
        try:
            return self._frames.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return self.TIMEOUT

    def write(self, data: bytes) -> None:
        self.proc.write(data)

    def exit_status(self) -> int | None:
        return self.proc.exit_status(timeout=1.0) if self.proc else None

    def close(self) -> None:
        """Idempotent; also how another thread aborts a call (blocked reads and writes fail)."""
        if self.proc is not None:
            self.proc.close()
        self.transport.close()

    def _read(self) -> None:
        try:
            self.proc.write(protocol.hello(self.spec))
        except OSError:
            pass
        reader = protocol.FrameReader()
        while chunk := self.proc.read_stdout():
            for kind, payload in reader.feed(chunk):
                if kind not in (b"H", b"W", b"O", b"E"):
                    self._frames.put((kind, payload))
        self._frames.put(self.END)

    def _read_stderr(self) -> None:
        splitter = protocol.LineSplitter()
        while chunk := self.proc.read_stderr():
            self._stderr.extend(line.decode("utf-8", "replace") for line in splitter.feed(chunk))
        self._stderr.extend(line.decode("utf-8", "replace") for line in splitter.flush())
        self._stderr_done.set()


def call_agent(node: NodeConfig, spec: dict, limit: float, until: bytes,
               transport: Transport | None = None, setup: bool = False) -> Reply:
    """Send ``spec`` and read frames until the ``until`` frame; bounded by ``limit`` seconds."""
    reply = Reply(node)
    call = AgentCall(node, spec, transport, setup)
    reply.problem = call.open()
    if reply.problem is not None:
        return reply
    try:
        reply.problem = call.wait_for(until, limit, reply.frames)
    finally:
        call.close()
    return reply


def on_each(nodes: list[NodeConfig], call: Callable[[NodeConfig], T]) -> list[T]:
    """``call`` on every node at once (threads: the work is waiting on the network)."""
    if not nodes:
        return []
    with ThreadPoolExecutor(max_workers=min(64, len(nodes))) as pool:
        return list(pool.map(call, nodes))
