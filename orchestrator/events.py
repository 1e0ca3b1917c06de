"""What node sessions report to the job loop. Plain values; one queue, one consumer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Union

from .errors import NodeProblem

Stream = Literal["out", "err", "node"]  # worker/launcher stdout, stderr, or the node's own diagnostics


class LogLine(NamedTuple):
    """One line of output (a NamedTuple: a chatty job makes hundreds of thousands of these)."""

    stream: Stream
    rank: int | None  # global rank; None for the launcher or the node itself
    text: str


@dataclass(frozen=True)
class Ready:
    node: int
    info: dict


@dataclass(frozen=True)
class SetupFailed:
    node: int
    problem: NodeProblem


@dataclass(frozen=True)
class Probed:
    """Whether the node could open a TCP connection to the master's addr:port."""

    node: int
    ok: bool
    error: str | None


@dataclass(frozen=True)
class Dumped:
    """The node signalled these ranks to print their stacks (which then arrive as stderr lines)."""

    node: int
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Started:
    node: int
    pid: int


@dataclass(frozen=True)
class Lines:
    node: int
    lines: list[LogLine] = field(default_factory=list)


@dataclass(frozen=True)
class Stopping:
    node: int
    reason: str


@dataclass(frozen=True)
class Exited:
    node: int
    code: int | None
    signal: str | None
    stopped: bool  # ended because we (or a signal to the agent) asked it to stop
    reason: str | None
    started: bool
    killed: int  # processes that needed SIGKILL


@dataclass(frozen=True)
class Closed:
    """The session's stream ended. Without an Exited first, the node is lost."""

    node: int
    exit_status: int | None
    stderr_tail: tuple[str, ...]


Event = Union[Ready, SetupFailed, Probed, Dumped, Started, Lines, Stopping, Exited, Closed]
