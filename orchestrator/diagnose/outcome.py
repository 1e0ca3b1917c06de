"""What a job is and was: per-node statuses, failures, the result, and the dashboard snapshot.

Plain values. The job loop (job.py) mutates NodeStatus; everything else is built from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from ..errors import EXIT_JOB_FAILED, EXIT_OK, NodeProblem
from ..node.protocol import policy, wire
from ..plan.launch import LaunchPlan, NodePlan
from ..node.watch.report import FailureReportParser

if TYPE_CHECKING:
    from ..node.protocol.stragglers import Lateness
    from .flight import Diagnosis

State = Literal["connecting", "ready", "starting", "running", "stopping",
                "done", "failed", "stopped", "lost", "error"]
"""One node's state in a job. The job loop (job.py) is the only writer.

    connecting --Ready--> ready --Go--> starting --Started--> running --Exited--> done | failed
        |                   |              |                    |
        |                   +--------------+--------------------+--Stopping--> stopping --Exited--> stopped
        |
        +--SetupFailed, Failed, channel closed, no Ready in time--> error

    connecting   connect, start the agent, preflight; nothing of the job runs yet
    ready        preflight passed; the agent holds until Go (the master holds the port)
    starting     Go sent; running once the agent reports the launcher Started
    stopping     the agent is stopping the job here (asked to, or on its own: a signal to it)
    done         the launcher exited 0 by itself
    failed       the launcher exited non-zero by itself (a rank failed)
    stopped      ended because a stop was asked for (fail-fast, Ctrl-C, a kill), or cancelled
                 while connecting; also a node that stopped on its own (then a failure)
    lost         the channel ended without Exited, or silence past orphan_timeout, or no stop
                 confirmation after SIGKILL: a sweep over a fresh connection follows
    error        could not connect or preflight: nothing was started there

From any non-terminal state: a stop request sends Stop (stop_grace + margin), then Kill (margin),
then the node is declared lost and swept. Terminal states never change.
"""
TERMINAL = frozenset({"done", "failed", "stopped", "lost", "error"})
# A rank's exit code that is the stop a launcher sends the survivors of a failure (SIGTERM, SIGINT,
# SIGHUP, as Popen and torchrun's report give it): a consequence, when it ties with another end
STOP_CODES = frozenset({-15, -2, -1})

FailureKind = Literal["own", "hung", "lost", "outside"]
"""Whose doing a failure was, which decides what a restart after it costs (attempts.py):
    own       the job's: a rank or its launcher exited non-zero by itself
    hung      the job's too: no progress for hang_timeout, stopped by ddp-up
    lost      the node's agent out of reach (network, node down): not the job's failure
    outside   the job stopped on the node by someone else: Slurm (time limit, preemption,
              scancel), a shutdown, a signal to the agent that ddp-up did not send
"""


@dataclass
class NodeStatus:
    plan: NodePlan
    state: State = "connecting"
    exit_code: int | None = None
    signal: str | None = None
    reason: str | None = None
    problem: NodeProblem | None = None  # why it is in state error
    slurm_cancel: str | None = None  # Slurm said it cancelled this node's step (srun transport)
    started_at: float | None = None
    ended_at: float | None = None
    stop_asked: float | None = None  # when ddp-up sent it Stop (the job loop's clock)
    lines: int = 0
    last_line: str = ""
    info: dict = field(default_factory=dict)  # the agent's Ready fields (versions, clock, disk, gpus)
    clock_skew: float | None = None  # node clock minus controller clock, seconds
    reach: wire.Probed | None = None
    gpus: list | None = None  # the last GpuUsage sample: [[index, util %, used MiB, total MiB]]
    report: FailureReportParser = field(default_factory=FailureReportParser)
    rank_errors: list = field(default_factory=list)  # its failed ranks' exceptions (rankfailures.RankError)
    results: dict = field(default_factory=dict)  # a function's launch: its ranks' Result frames, by global rank

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def outcome(self) -> NodeOutcome:
        took = None if self.stop_asked is None or self.ended_at is None else self.ended_at - self.stop_asked
        return NodeOutcome(self.plan, self.state, self.exit_code, self.signal, self.reason, self.lines, took)

    def row(self, now: float) -> NodeRow:
        uptime = None if self.started_at is None else (self.ended_at or now) - self.started_at
        code = self.signal or ("" if self.exit_code is None else str(self.exit_code))
        return NodeRow(self.plan.index, self.plan.label, self.plan.ranks, self.state, uptime, self.lines,
                       self.last_line, code, self.reason, gpu_summary(self.gpus))


@dataclass(frozen=True)
class NodeOutcome:
    """How one node ended (a value: the result outlives the job loop's mutable statuses)."""

    plan: NodePlan
    state: State
    exit_code: int | None
    signal: str | None
    reason: str | None
    lines: int
    stop_seconds: float | None = None  # from ddp-up's Stop to the node's end, when it was asked to stop

    @property
    def detail(self) -> str:
        """``stopped by ddp-up in 0.6 s``, ``SIGTERM from outside; stopped in 0.6 s``."""
        took = f"{self.stop_seconds:.1f} s" if self.stop_seconds is not None else ""
        if took and (self.reason or "").startswith("stopped"):
            return f"{self.reason} in {took}"
        return "; ".join(part for part in (self.reason, took and f"stopped in {took}") if part)


@dataclass(frozen=True)
class Failure:
    node: int
    label: str
    rank: int | None
    exit_code: int | None
    what: str
    at: float | None  # wall-clock time of the failure (its own when the node said; None: when it is recorded)
    exception: str | None = None  # the rank's own exception ("RuntimeError: ..."), when it raised one
    trace: tuple[str, ...] = ()  # the last lines of its traceback
    window: float = 0.0  # ``at`` is known to the second (torchrun's report): it may be this much later
    kind: FailureKind = "own"

    def render(self) -> str:
        who = f"{self.label} (node {self.node}" + (f", rank {self.rank})" if self.rank is not None else ")")
        return f"{who}: {self.what}" + (f": {self.exception}" if self.exception else "")


@dataclass(frozen=True)
class JobResult:
    plan: LaunchPlan
    nodes: tuple[NodeOutcome, ...]
    master_port: int | None
    failures: tuple[Failure, ...]
    interrupted: int | None = None  # signal number
    elapsed: float = 0.0
    # a replayed detached job (ddp-attach): its own start and end (wall clock) and master (addr:port)
    started: float | None = None
    ended: float | None = None
    master: str | None = None
    collectives: Diagnosis | None = None  # a hang's or a timeout's stuck collective (flight.py)
    lateness: tuple[Lateness, ...] = ()  # every node's lateness at collectives (stragglers.py)
    # a function's launch: {global rank: its return value as the rank pickled it, or why it did not come}
    values: dict = field(default_factory=dict, repr=False)

    @property
    def master_text(self) -> str:
        return self.master or f"{self.plan.master_addr}:{self.master_port}"

    @property
    def root_cause(self) -> Failure | None:
        return policy.earliest(self.failures, lambda f: f.at, lambda f: f.window, lambda f: f.exception,
                               lambda f: f.exit_code in STOP_CODES)

    def ending(self, attempts=()) -> str:
        """``job J ok after 17.0 s in 2 attempts (exit status 0)``: how the run ended, over all its
        attempts (``attempts``: their records, with ``started`` and ``ended``)."""
        verdict = "interrupted" if self.interrupted else ("ok" if self.exit_code == 0 else "FAILED")
        elapsed = attempts[-1].ended - attempts[0].started if len(attempts) > 1 else self.elapsed
        tries = f" in {len(attempts)} attempts" if len(attempts) > 1 else ""
        return f"job {self.plan.job_id} {verdict} after {elapsed:.1f} s{tries} (exit status {self.exit_code})"

    @property
    def exit_code(self) -> int:
        if self.interrupted:
            return 128 + self.interrupted
        if self.failures or any(n.state != "done" for n in self.nodes):
            return EXIT_JOB_FAILED
        return EXIT_OK


def gpu_summary(sample: list | None) -> str:
    if not sample:
        return ""
    utils = [g[1] for g in sample if g[1] is not None]
    used, total = (sum(g[i] or 0 for g in sample) / 1024 for i in (2, 3))
    util = f"{sum(utils) / len(utils):.0f}%" if utils else "-"
    return f"{util} {used:.0f}/{total:.0f}G"


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
    gpus: str = ""  # "87% 61/80G": mean utilization, memory used of total, over the node's GPUs
    late: str = ""  # a straggler: "late 180 ms at 92% of collectives" (stragglers.py)
    bar: str = ""  # what its chosen rank's progress bar shows now (progress.py)
    progress: str = ""  # "45% 36.2it/s eta 0:15", read from it
    slow: str = ""  # "0.61x": its rate against the others' median, where well below it


@dataclass(frozen=True)
class JobSnapshot:
    job_id: str
    master: str
    world_size: int
    elapsed: float
    phase: str
    nodes: tuple[NodeRow, ...]
    now: float
    attempt: int = 0
    quarantined: tuple[str, ...] = ()
    eta: float | None = None  # the job's: its slowest running node's (progress.py)
