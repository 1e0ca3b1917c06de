"""What the job loop consumes: one queue, one consumer. Plain values.

Node sessions post what their agent said (``Message`` carries a wire frame as it arrived; the
vocabulary is wire.py's, not repeated here), its output as ``Lines``, and how the channel ended.
A signal handler posts ``Wake``: the loop then reads the signal inbox at its next turn.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Union

from ..remote.channel import ChannelEnd
from ..errors import NodeProblem
from ..node.wire import Frame

Stream = Literal["out", "err", "node"]  # worker/launcher stdout, stderr, or the node's own diagnostics


class LogLine(NamedTuple):
    """One line of output (a NamedTuple: a chatty job makes hundreds of thousands of these)."""

    stream: Stream
    rank: int | None  # global rank; None for the launcher or the node itself
    text: str  # bytes that were not UTF-8 are kept as surrogates (the log files write them back)
    more: bool = False  # the line goes on in the next piece (a huge line, cut on the node)


@dataclass(frozen=True)
class Lines:
    node: int
    lines: list[LogLine] = field(default_factory=list)


@dataclass(frozen=True)
class Message:
    """A control frame from the node's agent (Ready, Failed, Probed, Started, Dumped, Stopping, Exited)."""

    node: int
    frame: Frame


@dataclass(frozen=True)
class SetupFailed:
    """The node could not be reached, or its agent not started."""

    node: int
    problem: NodeProblem


@dataclass(frozen=True)
class Closed:
    """The node's channel ended. Without an Exited first, the node is lost."""

    node: int
    end: ChannelEnd


class Wake:
    """A signal arrived (posted by the handler: SimpleQueue.put is safe there)."""


WAKE = Wake()

Event = Union[Lines, Message, SetupFailed, Closed, Wake]
