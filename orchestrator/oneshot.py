"""Run the node agent once in a one-shot mode (``sweep``, ``detect``) and collect its frames.

The same connection, bootstrap and framing as a launch; the agent answers and exits.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, TypeVar

from . import protocol
from .config import NodeConfig
from .errors import NodeProblem
from .transport import ConnectFailed, Transport, transport_for

T = TypeVar("T")


@dataclass
class Reply:
    node: NodeConfig
    frames: dict[bytes, dict] = field(default_factory=dict)  # the last JSON frame of each kind
    problem: NodeProblem | None = None  # could not connect, or no complete answer

    @property
    def error(self) -> str | None:
        return self.problem.what if self.problem else None

    def fail(self, what: str) -> None:
        if self.problem is None:
            self.problem = NodeProblem(self.node.label, what)


def call_agent(node: NodeConfig, spec: dict, limit: float, until: bytes,
               transport: Transport | None = None) -> Reply:
    """Send ``spec`` and read frames until the ``until`` frame; bounded by ``limit`` seconds."""
    reply = Reply(node)
    transport = transport or transport_for(node)
    try:
        transport.connect()
        proc = transport.start(node.python, protocol.bootstrap_args(), {})
    except ConnectFailed as e:
        reply.problem = e.problem
        return reply
    reader = threading.Thread(target=_collect, args=(proc, spec, until, reply), daemon=True)
    reader.start()
    reader.join(limit)
    if reader.is_alive():
        reply.fail(f"no answer from the node agent within {limit:.0f} s")
    proc.close()
    transport.close()
    return reply


def _collect(proc, spec: dict, until: bytes, reply: Reply) -> None:
    try:
        proc.write(protocol.hello(spec))
    except OSError:
        pass
    reader = protocol.FrameReader()
    while chunk := proc.read_stdout():
        for kind, payload in reader.feed(chunk):
            if kind not in (b"H", b"W", b"O", b"E"):
                reply.frames[kind] = protocol.decode_json(payload)
    if until not in reply.frames:
        reply.fail(f"the agent ended without an answer (exit status {proc.exit_status(timeout=1.0)})")


def on_each(nodes: list[NodeConfig], call: Callable[[NodeConfig], T]) -> list[T]:
    """``call`` on every node at once (threads: the work is waiting on the network)."""
    if not nodes:
        return []
    with ThreadPoolExecutor(max_workers=min(64, len(nodes))) as pool:
        return list(pool.map(call, nodes))
