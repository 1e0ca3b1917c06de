"""What the job loop consumes: one queue, one consumer. Plain values.

Node sessions post what their agent said (``Message`` carries a wire frame as it arrived; the
vocabulary is wire.py's, not repeated here), its output as ``Lines``, and how the channel ended.
A signal handler posts ``Wake``: the loop then reads the signal inbox at its next turn.

The report handlers (reports.py) turn an event into the node's new status and, for what is the
job's own (its master port, a failure, a lost node, a stop), into asks: the values at the end of
this module, which the loop applies. So the job's state changes in the loop alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Union

from ..diagnose.outcome import Failure
from ..errors import NodeProblem
from ..node.protocol.wire import Frame, JournalEnd
from ..remote.channel import ChannelEnd

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


@dataclass(frozen=True)
class Reshape:
    """The run changes its nodes: the job stops with its grace, and the next attempt starts at
    once on the new set (run/runloop.py). Nodes away from a smaller run that answered long enough
    (``join``: run/regrow.py, posted from its own thread), or a node that has straggled for
    `evict_after:` (``aside``: pace.py). Also the loop's ask, as it comes."""

    why: str  # what the console says
    join: frozenset[str] = frozenset()
    aside: str | None = None

    @property
    def end(self) -> str:
        """The attempt's end (attempts.ENDS)."""
        return "stopped to set a node aside" if self.aside else "stopped to grow"


class Wake:
    """A signal arrived (posted by the handler: SimpleQueue.put is safe there)."""


WAKE = Wake()

Event = Union[Lines, Message, SetupFailed, Closed, Reshape, Wake]


# --- what the report handlers ask of the loop ---

@dataclass(frozen=True)
class MasterPort:
    """The master's agent holds this port for the job (the first one reported is the job's)."""

    port: int


@dataclass(frozen=True)
class SupervisorPort:
    """A detached job's supervisor listens here, on the master node."""

    port: int


@dataclass(frozen=True)
class ChannelEnded:
    node: int


@dataclass(frozen=True)
class Record:
    """A failure, for the loop to record (the first one stops every node)."""

    failure: Failure


@dataclass(frozen=True)
class Lost:
    """The node's agent is out of reach: swept over a fresh connection, and maybe a failure."""

    node: int
    what: str


@dataclass(frozen=True)
class KilledBy:
    """ddp-kill stops the job on this node: the run ends as for a SIGTERM to ddp-up."""

    node: int


@dataclass(frozen=True)
class JournalRead:
    """Following a detached job: this node's journal was read to its end."""

    node: int
    frame: JournalEnd


Ask = Union[MasterPort, SupervisorPort, ChannelEnded, Record, Lost, KilledBy, JournalRead, Reshape]
