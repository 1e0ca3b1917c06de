"""One node's session: connect, ship the agent, relay its frames as events, send commands.

Blocking I/O lives in this module's threads (a reader per stream, one writer), so the job loop
on the main thread only ever waits on its event queue and never on the network.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from typing import Callable

from . import protocol
from .errors import NodeProblem
from .events import Closed, Dumped, Exited, Lines, LogLine, Probed, Ready, SetupFailed, Started, Stopping
from .plan import LaunchPlan, NodePlan
from .transport import ConnectFailed, RemoteProcess, Transport


class NodeSession:
    def __init__(self, plan: LaunchPlan, node: NodePlan, transport: Transport,
                 post: Callable[[object], None], clock: Callable[[], float] = time.monotonic):
        self.plan = plan
        self.node = node
        self.transport = transport
        self.post = post
        self.clock = clock
        self.last_heard = clock()
        self.proc: RemoteProcess | None = None
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._stderr_tail: deque[str] = deque(maxlen=20)
        self._threads: list[threading.Thread] = []
        self._cancelled = threading.Event()

    # --- lifecycle (open runs on a pool thread) ---

    def open(self) -> None:
        """Connect and start the agent; every failure is posted as SetupFailed, never raised."""
        try:
            self.transport.connect()
            if self._cancelled.is_set():
                raise ConnectFailed(NodeProblem(self.node.label, "cancelled while connecting"))
            self.proc = self.transport.start(self.node.config.python, protocol.bootstrap_args(),
                                             self.node.tags(self.plan), self.node.config.setup, self.node.workdir)
        except ConnectFailed as e:
            self.post(SetupFailed(self.node.index, e.problem))
            return
        except Exception as e:  # noqa: BLE001 - a bug or odd server must not kill the controller
            self.post(SetupFailed(self.node.index, NodeProblem(self.node.label, f"cannot start the agent: {e}")))
            return
        self.last_heard = self.clock()
        self._stderr_reader = self._spawn(self._read_stderr, "stderr")
        self._spawn(self._read_frames, "frames")
        # The hello goes first on the wire whatever was queued before it: the agent compiles
        # exactly its source's length of bytes, so a heartbeat ahead of it (the job loop sends
        # one as soon as it sees self.proc) would shift the source and break it.
        self._spawn(lambda: self._write_loop(protocol.hello(self.plan.agent_spec(self.node))), "writer")
        if self._cancelled.is_set():
            self.close()

    def cancel(self) -> None:
        """Stop before start: a connecting session closes as soon as it can."""
        self._cancelled.set()
        if self.proc is not None:
            self.close()

    def send(self, data: bytes) -> None:
        self._outbox.put(data)

    def close(self) -> None:
        """Close stdin then the stream: the agent treats EOF as 'controller gone' and stops."""
        self._outbox.put(None)
        if self.proc is not None:
            self.proc.close()

    def disconnect(self, timeout: float = 2.0) -> None:
        self.close()
        for t in self._threads:
            t.join(timeout)
        self.transport.close()

    # --- threads ---

    def _spawn(self, target, name: str) -> threading.Thread:
        t = threading.Thread(target=target, name=f"{self.node.label}-{name}", daemon=True)
        t.start()
        self._threads.append(t)
        return t

    def _write_loop(self, hello: bytes) -> None:
        try:
            self.proc.write(hello)
        except (OSError, EOFError):
            return
        while True:
            data = self._outbox.get()
            if data is None or self.proc is None:
                return
            try:
                self.proc.write(data)
            except (OSError, EOFError):
                return  # the reader sees the close and reports it

    def _read_stderr(self) -> None:
        splitter = protocol.LineSplitter()
        while chunk := self.proc.read_stderr():
            for line in splitter.feed(chunk):
                self._node_line(line)
        for line in splitter.flush():
            self._node_line(line)

    def _node_line(self, raw: bytes) -> None:
        text = raw.decode("utf-8", "replace").rstrip("\r")
        self._stderr_tail.append(text)
        self.post(Lines(self.node.index, [LogLine("node", None, text)]))

    def _read_frames(self) -> None:
        reader = protocol.FrameReader()
        while chunk := self.proc.read_stdout():
            self.last_heard = self.clock()
            self._dispatch(reader.feed(chunk))
        status = self.proc.exit_status(timeout=2.0)
        # The last stderr lines explain an early exit (a failed setup command, python not found):
        # let the stderr reader reach its end before reporting, or they can miss the report.
        self._stderr_reader.join(2.0)
        self.post(Closed(self.node.index, status, tuple(self._stderr_tail)))

    def _dispatch(self, frames: list[tuple[bytes, object]]) -> None:
        batch: list[LogLine] = []
        for kind, payload in frames:
            if kind == b"W":
                rank = self.node.first_rank + payload.local_rank
                batch.extend(LogLine(payload.stream, rank, text) for text in payload.lines())
                continue
            if kind in (b"O", b"E"):  # the launcher's own output: no rank
                batch.append(LogLine("out" if kind == b"O" else "err", None,
                                     payload.decode("utf-8", "replace").rstrip("\r")))
                continue
            if batch:
                self.post(Lines(self.node.index, batch))
                batch = []
            if kind != b"H":
                self.post(self._control_event(kind, protocol.decode_json(payload)))
        if batch:
            self.post(Lines(self.node.index, batch))

    def _control_event(self, kind: bytes, data: dict) -> object:
        n = self.node.index
        if kind == b"R":
            return Ready(n, data)
        if kind == b"F":
            return SetupFailed(n, NodeProblem(self.node.label, data.get("what", "preflight failed"), data.get("fix", "")))
        if kind == b"Y":
            return Dumped(n, tuple(data.get("ranks", ())))
        if kind == b"C":
            return Probed(n, bool(data.get("ok")), data.get("error"))
        if kind == b"S":
            return Started(n, int(data.get("pid", 0)))
        if kind == b"P":
            return Stopping(n, str(data.get("reason", "")))
        if kind == b"X":
            return Exited(n, data.get("code"), data.get("signal"), bool(data.get("stopped")), data.get("reason"),
                          bool(data.get("started", True)), int(data.get("killed") or 0))
        return Lines(n, [LogLine("node", None, f"unexpected frame from agent: {kind!r}")])
