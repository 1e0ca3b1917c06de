"""Following a detached job (Job.follow): what its nodes' journals say of it, one attempt."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from ..diagnose.outcome import JobResult
from ..node.protocol import wire
from .backlog import BacklogOrder


@dataclass
class Following:
    """An attach's reading of a detached job's journals, one attempt (see Job.follow)."""

    journal_ended: set[int] = field(default_factory=set)  # nodes whose journal was read to its end
    later_attempt: bool = False  # a node's journal said a later attempt follows
    absent: set[int] = field(default_factory=set)  # nodes where this attempt never began (the job ended first)
    started: float | None = None  # the job's own start and end (wall clock), by its nodes' records
    ended: float | None = None
    master: str | None = None  # its master, addr:port, as the master node's record says
    next: str | None = None  # what its supervisor decided after this attempt, as the master node says
    nodes: list[int] | None = None  # an elastic job's: the nodes of the next attempt, as the master node says,
    lost: int | None = None  # the node (index in the cluster file) its supervisor found lost, the root cause,
    lost_why: str | None = None  # and why it found it lost,
    reshaped: str | None = None  # and whether it stopped this attempt to change its nodes: "grow", "aside"
    over: bool = False  # the master node's word: no attempt follows this one
    order: BacklogOrder | None = None  # the nodes' journals, merged in time order
    told_held: bool = False  # the attach said which nodes the others' lines wait for (phases.held_back)

    def result(self, result: JobResult) -> JobResult:
        """The replay's result, with the job's own times and master rather than the attach's."""
        if self.started is None:
            return result
        ended = self.ended if self.ended is not None else time.time()
        return replace(result, started=self.started, ended=self.ended, elapsed=ended - self.started,
                       master=self.master)

    @property
    def said_all(self) -> set[int]:
        """The nodes that have nothing more to say: their journal's end read, or arrived and held
        (order.ended): their silence is no loss."""
        return self.journal_ended | (self.order.ended if self.order else set())

    def journal_read(self, node: int, frame: wire.JournalEnd, is_master: bool) -> None:
        """This node's journal was read to its end (JournalRead)."""
        self.journal_ended.add(node)
        self.later_attempt |= frame.later
        self.record(frame, is_master)
        if frame.absent:
            self.absent.add(node)

    def record(self, frame: wire.JournalEnd | wire.Replayed, is_master: bool) -> None:
        """What a node's record says of the job, from its JournalEnd (or, while it runs, Replayed)."""
        started, ended, after = frame.started, getattr(frame, "ended", None), getattr(frame, "next", None)
        if isinstance(started, (int, float)) and not isinstance(started, bool):
            self.started = min(self.started or started, started)
        if isinstance(ended, (int, float)) and not isinstance(ended, bool):
            self.ended = max(self.ended or ended, ended)
        if is_master and isinstance(frame.master, str):
            self.master = frame.master[:300]
        if isinstance(after, str):
            self.next = after[:500]
        nodes, lost = getattr(frame, "nodes", None), getattr(frame, "lost", None)
        if is_master and isinstance(nodes, list) and all(type(n) is int for n in nodes):
            self.nodes = nodes
        if is_master and type(lost) is int:
            self.lost = lost
            why = getattr(frame, "lost_why", None)
            self.lost_why = why[:500] if isinstance(why, str) else None
        if is_master and getattr(frame, "reshaped", None) in ("grow", "aside"):
            self.reshaped = frame.reshaped
        self.over |= is_master and getattr(frame, "over", False) is True
