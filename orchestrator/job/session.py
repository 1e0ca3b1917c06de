"""One node of a job: its agent channel, with what the agent says turned into job events.

Output frames become ``Lines`` (global ranks, secrets masked before anything keeps or shows a
line); the agent's own stderr becomes ``node`` lines; every other frame is passed on as a
``Message``; the channel's end as ``Closed``.
"""

from __future__ import annotations

import time
from typing import Callable

from ..node.protocol import wire
from ..plan.launch import LaunchPlan, NodePlan
from ..remote.channel import AgentChannel, ChannelEnd
from ..remote.transport import ConnectFailed, Transport
from .events import Closed, Lines, LogLine, Message, SetupFailed


class NodeSession:
    def __init__(self, plan: LaunchPlan, node: NodePlan, transport: Transport,
                 post: Callable[[object], None], clock: Callable[[], float] = time.monotonic,
                 follow: wire.FollowSpec | None = None):
        self.plan = plan
        self.node = node
        self.post = post
        if follow is None:  # a launch: the agent runs the job, tagged as its process and in its setup
            self.channel = AgentChannel(node.config, transport, plan.agent_spec(node), self._frames, self._end,
                                        on_stderr=self._stderr, tags=node.tags(plan), setup=node.config.setup,
                                        workdir=node.workdir, clock=clock)
        else:  # an attach: the agent reads a detached job's journal, and is none of the job's processes
            self.channel = AgentChannel(node.config, transport, follow, self._frames, self._end,
                                        on_stderr=self._stderr, clock=clock)

    @property
    def last_heard(self) -> float:
        return self.channel.last_heard

    @property
    def heard(self) -> bool:
        """The agent has said something: from then on, its silence is judged by orphan_timeout."""
        return self.channel.heard

    @property
    def logged_in(self) -> bool | None:
        """Whether the node was reached (its shell's first byte, over OpenSSH); None: the transport cannot tell."""
        return getattr(self.channel.proc, "logged_in", None)

    @property
    def started(self) -> bool:
        """The agent process exists (heartbeats can go)."""
        return self.channel.proc is not None

    def open(self) -> None:
        """Connect and start the agent (on a connect thread); a failure is posted, never raised."""
        try:
            self.channel.open()
        except ConnectFailed as e:
            self.post(SetupFailed(self.node.index, e.problem))

    def send(self, frame: wire.Frame) -> None:
        self.channel.send(frame)

    def cancel(self) -> None:
        self.channel.cancel()

    def close(self) -> None:
        self.channel.close()

    def disconnect(self, wait: bool = True) -> None:
        """``wait``: for the agent's last words (not from a node lost: nothing more comes)."""
        self.channel.disconnect(timeout=2.0 if wait else 0.0)

    def _frames(self, frames: list[wire.Frame]) -> None:
        batch: list[LogLine] = []
        for frame in frames:
            if isinstance(frame, wire.Output):  # the hot path: a chatty job sends 100k+ lines a second
                rank = None if frame.rank is None else self.node.first_rank + frame.rank
                lines, tail = frame.split()
                if self.plan.secrets:
                    lines, tail = [self.plan.mask(t) for t in lines], self.plan.mask(tail)
                stream = frame.stream
                batch += [LogLine(stream, rank, text) for text in lines]
                if tail:
                    batch.append(LogLine(stream, rank, tail, True))
                continue
            if batch:  # keep order: lines before a control frame are posted before it
                self.post(Lines(self.node.index, batch))
                batch = []
            if not isinstance(frame, wire.Heartbeat):
                self.post(Message(self.node.index, frame))
        if batch:
            self.post(Lines(self.node.index, batch))

    def _stderr(self, text: str) -> None:
        self.post(Lines(self.node.index, [LogLine("node", None, self._mask(text))]))

    def _end(self, end: ChannelEnd) -> None:
        self.post(Closed(self.node.index, end))

    def _mask(self, text: str) -> str:
        return self.plan.mask(text) if self.plan.secrets else text
