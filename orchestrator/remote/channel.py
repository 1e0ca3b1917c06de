"""One agent channel: a node agent's process behind a transport, speaking wire.py's frames.

The job's node sessions and the one-shot calls (``gpus: auto``, sweeps, sync) all talk to their
agent through this class: connect, start the agent, send the hello first, read frames, keep the
agent's last stderr lines (they explain an early exit), report the end once.

Blocking I/O lives in this module's threads (a frame reader, a stderr reader, one writer), so a
caller never waits on the network unless it asks to (``write``), and every such wait is bounded
by the caller's own deadline (it can ``close`` the channel from another thread).
"""

from __future__ import annotations

import queue
import re
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from ..config.cluster import NodeConfig
from ..errors import NodeProblem
from ..node.main import AGENT_FAILED
from ..node.protocol import wire
from . import protocol
from .openssh import ssh_failure
from .transport import SETUP_FAILED, SETUP_MARK, ConnectFailed, RemoteProcess, Transport

STDERR_TAIL = 20  # lines of the agent's own stderr kept to explain an early exit


_SETUP_FAILURE = re.compile(re.escape(SETUP_MARK) + r" (\d+) failed with status (\d+)")


def early_exit_problem(node: NodeConfig, exit_status: int | None, stderr_tail: Sequence[str]) -> NodeProblem:
    """Why an agent ended before it answered, from its shell's exit status and last stderr lines:
    a failed setup command (which one, its status, what it printed), no such python, or else."""
    tail = " | ".join(stderr_tail[-3:])
    if exit_status == 255 and node.transport == "ssh" and node.ssh.client == "openssh":
        return ssh_failure(node, stderr_tail)  # ssh's own status for "could not connect or run"
    if exit_status == SETUP_FAILED:
        found = next(filter(None, (_SETUP_FAILURE.match(line) for line in stderr_tail)), None)
        number, status = (int(found.group(1)), found.group(2)) if found else (0, "?")
        command = node.setup[number - 1] if 0 < number <= len(node.setup) else "?"
        output = " | ".join(line for line in stderr_tail[-4:] if not _SETUP_FAILURE.match(line))
        return NodeProblem(node.label, f"setup command {number} `{command}` failed with status {status}"
                           + (f": {output}" if output else ""),
                           "fix it in `setup:`, or run it by hand on the node to see why")
    if exit_status == AGENT_FAILED:
        return NodeProblem(node.label, "the node agent failed" + (f": {tail}" if tail else ""),
                           "a bug in ddp-up: please report it, with these lines of the agent's traceback")
    if exit_status == 127:
        return NodeProblem(node.label, f"python not found: {node.python!r} ({tail})",
                           "set `python:` to the interpreter's absolute path on that node")
    return NodeProblem(node.label, f"the node agent exited before it was ready (status {exit_status})"
                       + (f": {tail}" if tail else ""), "run the same python on the node by hand")


@dataclass(frozen=True)
class ChannelEnd:
    """The agent's output ended: how, and its last words."""

    exit_status: int | None
    stderr_tail: tuple[str, ...]
    protocol_error: str | None = None  # the agent sent something that is not a frame

    def problem(self, node: NodeConfig, before: str) -> NodeProblem:
        """Why the agent ended ``before`` it said what it was asked for."""
        if self.protocol_error:
            return NodeProblem(node.label, f"protocol error from the node agent: {self.protocol_error}",
                               "use the same ddp-up version everywhere; report it if it persists")
        if self.exit_status:
            return early_exit_problem(node, self.exit_status, self.stderr_tail)
        return NodeProblem(node.label, f"the agent ended {before} (exit status {self.exit_status})")


class AgentChannel:
    def __init__(self, node: NodeConfig, transport: Transport, spec: wire.Frame | None,
                 on_frames: Callable[[list[wire.Frame]], None], on_end: Callable[[ChannelEnd], None],
                 on_stderr: Callable[[str], None] | None = None, tags: Mapping[str, str] | None = None,
                 setup: tuple[str, ...] = (), workdir: str | None = None,
                 clock: Callable[[], float] = time.monotonic, mode: type | None = None):
        self.node = node
        self.transport = transport
        self.spec = spec  # None: the caller's first ``send`` is the spec (see protocol.hello)
        self.mode = mode  # without a spec, the kind it will be: the agent is sent that mode's modules
        self.on_frames = on_frames  # each read's frames, in order, in one call
        self.on_end = on_end
        self.on_stderr = on_stderr
        self.tags = dict(tags or {})
        self.setup = setup  # bash commands run first, in workdir: the agent then sees the job's environment
        self.workdir = workdir
        self.clock = clock
        self.last_heard = clock()
        self.heard = False  # whether the agent said anything yet (its start may take longer than a heartbeat)
        self.proc: RemoteProcess | None = None
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._write_lock = threading.Lock()
        self._hello_sent = threading.Event()
        self._stderr_tail: deque[str] = deque(maxlen=STDERR_TAIL)
        self._threads: list[threading.Thread] = []
        self._cancelled = threading.Event()

    # --- lifecycle ---

    def open(self) -> None:
        """Connect and start the agent (blocks for the connect); raises ConnectFailed."""
        self.transport.connect()
        if self._cancelled.is_set():
            raise ConnectFailed(NodeProblem(self.node.label, "cancelled while connecting"))
        try:
            proc = self.transport.start(self.node.python, protocol.bootstrap_args(self.tags), self.tags,
                                        self.setup, self.workdir)
        except ConnectFailed:
            raise
        except Exception as e:  # noqa: BLE001 - a bug or odd server must not kill the controller
            raise ConnectFailed(NodeProblem(self.node.label, f"cannot start the agent: {e}")) from None
        self.last_heard = self.clock()  # its start (past ssh's start slot) first: silence counts from here
        self.proc = proc
        stderr_reader = self._spawn(self._read_stderr, "stderr")
        self._spawn(lambda: self._read_frames(stderr_reader), "frames")
        # The hello goes first on the wire whatever was queued before it: the agent compiles
        # exactly its sources' length of bytes, so a heartbeat ahead of it would break it.
        self._spawn(self._write_loop, "writer")
        if self._cancelled.is_set():
            self.close()

    def cancel(self) -> None:
        """Stop before start: a connecting channel closes as soon as it can."""
        self._cancelled.set()
        if self.proc is not None:
            self.close()

    def send(self, frame: wire.Frame) -> None:
        """Queue a frame; never blocks (the writer thread sends it after the hello)."""
        self._outbox.put(frame.encode())

    def write(self, data: bytes) -> None:
        """Write now, blocking (bulk data: the sync's files). Raises OSError once the stream is gone."""
        if self.proc is None:
            raise OSError("not connected")
        self._hello_sent.wait()
        with self._write_lock:
            self.proc.write(data)

    def close(self) -> None:
        """Close stdin then the stream: the agent treats EOF as 'controller gone' and stops.
        Idempotent; also how another thread aborts a blocked read or write."""
        self._outbox.put(None)
        if self.proc is not None:
            self.proc.close()

    def disconnect(self, timeout: float = 2.0) -> None:
        """Close, let the threads read what the agent said last (within ``timeout``, all of them
        together: a link that is down answers nothing), then end the transport."""
        self.close()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self.transport.close()

    # --- threads ---

    def _spawn(self, target, name: str) -> threading.Thread:
        t = threading.Thread(target=target, name=f"{self.node.label}-{name}", daemon=True)
        t.start()
        self._threads.append(t)
        return t

    def _write_loop(self) -> None:
        try:
            with self._write_lock:
                for part in protocol.hello(self.spec, self.mode):
                    self.proc.write(part)
        except (OSError, EOFError):
            return
        finally:
            self._hello_sent.set()
        while True:
            data = self._outbox.get()
            if data is None:
                return
            try:
                with self._write_lock:
                    self.proc.write(data)
            except (OSError, EOFError):
                return  # the reader sees the close and reports it

    def _read_stderr(self) -> None:
        splitter = protocol.LineSplitter()
        while chunk := self.proc.read_stderr():
            for line in splitter.feed(chunk):
                self._stderr_line(line)
        for line in splitter.flush():
            self._stderr_line(line)

    def _stderr_line(self, raw: bytes) -> None:
        text = raw.decode("utf-8", "replace").rstrip("\r")
        self._stderr_tail.append(text)
        if self.on_stderr is not None:
            self.on_stderr(text)

    def _read_frames(self, stderr_reader: threading.Thread) -> None:
        decoder = wire.Decoder(wire.TO_CONTROLLER)
        error = None
        while chunk := self.proc.read_stdout():
            self.last_heard, self.heard = self.clock(), True
            try:
                frames = decoder.feed(chunk)
            except wire.ProtocolError as e:
                error = str(e)
                self.close()  # the agent sees EOF and stops whatever it started
                break
            if frames:
                self.on_frames(frames)
        status = self.proc.exit_status(timeout=2.0)
        # The last stderr lines explain an early exit (a failed setup command, python not found):
        # let the stderr reader reach its end before reporting, or they can miss the report.
        stderr_reader.join(2.0)
        self.on_end(ChannelEnd(status, tuple(self._stderr_tail), error))
