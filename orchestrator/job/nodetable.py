"""Every node's status in one job, and the one place a node's state changes (the views hear of each
change); the failures so far; and what the dashboard and the result read of them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Iterator

from ..diagnose.outcome import TERMINAL, Failure, FailureKind, NodeOutcome, NodeRow, NodeStatus, State
from ..errors import NodeProblem
from ..plan.launch import LaunchPlan


class NodeTable:
    def __init__(self, plan: LaunchPlan, view, clock: Callable[[], float], wall: Callable[[], float]):
        self.plan = plan
        self.view = view
        self.clock = clock
        self.wall = wall
        self.status = [NodeStatus(n) for n in plan.nodes]
        self.failures: list[Failure] = []

    def __getitem__(self, node: int) -> NodeStatus:
        return self.status[node]

    def __iter__(self) -> Iterator[NodeStatus]:
        return iter(self.status)

    def set(self, node: int, state: State, reason: str | None = None) -> None:
        """The one state change (transitions: outcome.State)."""
        status = self.status[node]
        status.state = state
        if reason is not None:
            status.reason = reason
        if state in TERMINAL:
            status.ended_at = self.clock()
        self.view.node_state(status)

    def error(self, node: int, problem: NodeProblem) -> None:
        self.status[node].problem = problem
        self.set(node, "error", reason=problem.what)

    def failure(self, node: int, rank: int | None, code: int | None, what: str, at: float | None = None,
                kind: FailureKind = "own") -> Failure:
        return Failure(node, self.plan.nodes[node].label, rank, code, what, at, kind=kind)

    def fail(self, failure: Failure) -> Failure:
        """A failure, at its own time when the node said when (else now, by the wall clock)."""
        if failure.at is None:
            failure = replace(failure, at=self.wall())
        self.failures.append(failure)
        return failure

    @property
    def ended(self) -> bool:
        return all(s.terminal for s in self.status)

    def problems(self) -> list[NodeProblem]:
        return [s.problem for s in self.status if s.problem is not None]

    def phase(self, stopping: bool, interrupted: bool) -> str:
        """The job's phase, as the dashboard names it."""
        if self.ended:
            return "done" if all(s.state == "done" for s in self.status) else "failed"
        if stopping:
            return "failing" if self.failures and not interrupted else "stopping"
        if any(s.state in ("connecting", "ready") for s in self.status):
            return "connecting"
        return "running"

    def rows(self, now: float) -> tuple[NodeRow, ...]:
        return tuple(s.row(now) for s in self.status)

    def outcomes(self) -> tuple[NodeOutcome, ...]:
        return tuple(s.outcome() for s in self.status)
