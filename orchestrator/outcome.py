"""What a job is and was: per-node statuses, failures, the result, and the dashboard snapshot.

Plain values. The job loop (job.py) mutates NodeStatus; everything else is built from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .errors import EXIT_JOB_FAILED, EXIT_OK
from .cleanup import SweepReport
from .events import Probed
from .logparse import FailureReportParser
from .plan import LaunchPlan, NodePlan

State = Literal["connecting", "ready", "starting", "running", "stopping",
                "done", "failed", "stopped", "lost", "error"]
TERMINAL = frozenset({"done", "failed", "stopped", "lost", "error"})


@dataclass
class NodeStatus:
    plan: NodePlan
    state: State = "connecting"
    exit_code: int | None = None
    signal: str | None = None
    reason: str | None = None
    pid: int | None = None
    started_at: float | None = None
    ended_at: float | None = None
    lines: int = 0
    last_line: str = ""
    info: dict = field(default_factory=dict)  # the agent's ready report (versions, clock, disk, gpus)
    clock_skew: float | None = None  # node clock minus controller clock, seconds
    reach: Probed | None = None
    report: FailureReportParser = field(default_factory=FailureReportParser)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL


@dataclass(frozen=True)
class Failure:
    node: int
    label: str
    rank: int | None
    exit_code: int | None
    what: str
    at: float  # wall-clock time of the failure (the node's own report when there is one)

    def render(self) -> str:
        who = f"{self.label} (node {self.node}" + (f", rank {self.rank})" if self.rank is not None else ")")
        return f"{who}: {self.what}"


@dataclass
class JobResult:
    plan: LaunchPlan
    nodes: list[NodeStatus]
    master_port: int | None
    failures: list[Failure]
    interrupted: int | None = None  # signal number
    sweeps: list[SweepReport] = field(default_factory=list)
    elapsed: float = 0.0

    @property
    def root_cause(self) -> Failure | None:
        return min(self.failures, key=lambda f: f.at) if self.failures else None

    @property
    def exit_code(self) -> int:
        if self.interrupted:
            return 128 + self.interrupted
        if self.failures or any(n.state != "done" for n in self.nodes):
            return EXIT_JOB_FAILED
        return EXIT_OK


@dataclass(frozen=True)
class NodeRow:
    """One node as the dashboard shows it."""

    index: int
    label: str
    ranks: range
    state: State
    uptime: float | None
    lines: int
    last_line: str
    exit: str
    reason: str | None


@dataclass(frozen=True)
class JobSnapshot:
    job_id: str
    master: str
    world_size: int
    elapsed: float
    phase: str
    nodes: tuple[NodeRow, ...]
    now: float
