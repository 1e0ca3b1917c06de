"""Hang detection: when a running job looks hung, and which ranks to name. Decisions as values.

A rank's hang clock starts when its process group is up (the Flight Recorder's hook says so:
RanksUp) or at its first line, whichever comes first: importing torch on a loaded node or from a
venv on NFS takes a while and is no hang. Until every running rank has begun, start-up has its own
limit and its own words ("rank 3 has not reached init_process_group after 600 s"). After that, a
job looks hung when no rank printed for ``hang_timeout`` seconds, or when some nodes finished
that long ago while others still run (policy.hang_reason: a detached job's supervisor applies the
same rule, counted from the launch). A node whose ranks have all ended (RanksEnded: the node
watches its workers' processes end) is finishing, not hung: its launcher may wait at torchrun's
exit barrier for seconds, and its silence is counted for no one. Where that word comes while the
stacks are being asked for, no one is named, and the watch starts again (Finishing). The watch then asks for every rank's stack (``AskStacks``;
the job sends Dump), waits for the nodes to confirm and the stacks to arrive, and names the
ranks that look stuck (``Hung``): with stacks, the odd ones out by the collective they wait in;
without, the quietest ranks. The job loop acts on the decisions; this module does no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from ..diagnose.logparse import StackReport
from ..diagnose.outcome import NodeStatus
from ..node.protocol import policy
from .events import LogLine

DUMP_SETTLE = 1.5  # after every node confirmed its dump signals, time for the stacks to arrive
# once every rank of the job has ended, how long torchrun's exit barrier is given before the launchers
# still at it are stopped: it waits 300 s for a launcher that ended without it (a death in its teardown)
FINISH_WAIT = 5.0
LINGERED = "every rank has ended; torchrun's exit barrier waited for a node whose launcher had ended"
Blamed = Callable[[], "tuple[tuple[int, ...], str] | None"]  # the Flight Recorder's word (flight.FlightLog.blamed)


@dataclass(frozen=True)
class AskStacks:
    why: str
    nodes: tuple[int, ...]  # the running nodes to send Dump to


@dataclass(frozen=True)
class Finishing:
    """The stacks were asked for, and meanwhile every node said its ranks had ended: the
    launchers are finishing."""

    what: str


@dataclass(frozen=True)
class Hung:
    node: int
    rank: int
    what: str


class HangWatch:
    def __init__(self, timeout: float | None, job_id: str, startup: float | None = None):
        self.timeout = timeout
        self.job_id = job_id
        self.startup = policy.startup_limit(startup, timeout)
        self.launched: float | None = None  # when the job was started; None until go
        self.begun: dict[int, float] = {}  # rank -> when its clock started (process group up, or first line)
        self.late_starters: list[int] = []  # the ranks a start-up hang is declared for
        self.waited = 0.0  # how long after the launch it was declared
        self.last_output: float | None = None  # any rank's latest sign of life; None until one begins
        self.rank_last: dict[int, float] = {}
        self.first_done: float | None = None
        self.why: str | None = None  # set once the job was declared hung
        self.stacks = StackReport()
        self.pending: set[int] = set()  # nodes asked for stacks that have not confirmed
        self.deadline: float | None = None  # when to name the stuck ranks
        self.finishing: set[int] = set()  # nodes whose ranks have all ended: their launchers finish
        self.all_ended: float | None = None  # when every rank of the job had ended (lingering)

    def started(self, now: float) -> None:
        self.launched = now

    def lines(self, lines: Sequence[LogLine], now: float) -> None:
        for line in lines:
            if line.rank is not None:
                self.begun.setdefault(line.rank, now)
                self.last_output = self.rank_last[line.rank] = now
                if self.why and line.stream == "err":
                    self.stacks.feed(line.rank, line.text)

    def moved(self, ranks: Sequence[int], now: float) -> None:
        """These ranks' progress bars moved: progress, as a line is."""
        for rank in ranks:
            self.begun.setdefault(rank, now)
            self.last_output = self.rank_last[rank] = now

    def ranks_up(self, ranks: Sequence[int], now: float) -> None:
        """These ranks' process groups are up: their clocks start, if no line started them."""
        for rank in ranks:
            if rank not in self.begun:
                self.begun[rank] = self.last_output = self.rank_last[rank] = now

    def node_done(self, now: float) -> None:
        self.first_done = self.first_done or now

    def ranks_ended(self, node: int, now: float) -> None:
        """Every rank of ``node`` has ended; its launcher goes on a while (finishing, not hung)."""
        self.finishing.add(node)
        self.node_done(now)

    def dumped(self, node: int, now: float) -> None:
        self.pending.discard(node)
        if not self.pending and self.deadline is not None:
            self.deadline = min(self.deadline, now + DUMP_SETTLE)

    def check(self, now: float, statuses: Sequence[NodeStatus], stopping: bool,
              blamed: Blamed = lambda: None) -> AskStacks | Hung | None:
        """What the job should do now about a hang, if anything. ``blamed``: the ranks the others
        wait for in a collective, by the ranks' records, if they say."""
        if self.deadline is not None and now >= self.deadline:
            self.deadline = None
            if not self._running(statuses):
                return self._rearm(now)
            return self._name_stuck(statuses, blamed=blamed)
        if self.why or stopping or self.launched is None:
            return None
        running = self._running(statuses)
        waiting = [r for s in running for r in s.plan.ranks if r not in self.begun]
        if waiting:  # start-up: the silence clock has not started
            why = policy.startup_reason(now - self.launched, self.startup, waiting)
            if why:
                self.late_starters, self.waited = waiting, now - self.launched
                return self._declare(why, running, now)
            return None
        if not self.timeout or self.last_output is None:
            return None
        why = policy.hang_reason(now, self.last_output, self.first_done, self.timeout, len(running))
        return self._declare(why, running, now) if why else None

    def lingering(self, now: float, statuses: Sequence[NodeStatus]) -> tuple[int, ...]:
        """The nodes whose launchers still run FINISH_WAIT after every rank of the job ended (some
        node had ended, each other said its ranks had): they wait at torchrun's exit barrier for a
        node whose launcher ended without reaching it, and would for 300 s. Their work is done."""
        left = [s for s in statuses if not s.terminal]
        if not left or len(left) == len(statuses) or any(s.plan.index not in self.finishing for s in left):
            # (every launcher still runs: they all reach the barrier, which then completes by itself)
            self.all_ended = None
            return ()
        self.all_ended = self.all_ended if self.all_ended is not None else now
        return tuple(s.plan.index for s in left) if now - self.all_ended >= FINISH_WAIT else ()

    @property
    def linger_deadline(self) -> float | None:
        return None if self.all_ended is None else self.all_ended + FINISH_WAIT

    def _running(self, statuses: Sequence[NodeStatus]) -> list[NodeStatus]:
        """The nodes whose ranks may still run: running, and not finishing."""
        return [s for s in statuses if s.state == "running" and s.plan.index not in self.finishing]

    def _rearm(self, now: float) -> Finishing:
        """A hang declared while the last ranks ended: none is named, and the watch starts again."""
        self.why, self.stacks, self.last_output = None, StackReport(), now
        return Finishing("every rank has ended; their launchers are finishing (torchrun's exit barrier), "
                         "which is no hang")

    def _declare(self, why: str, running: list[NodeStatus], now: float) -> AskStacks:
        self.why = why
        self.pending = {s.plan.index for s in running}
        self.deadline = now + policy.HANG_DUMP_WAIT
        return AskStacks(why, tuple(sorted(self.pending)))

    def name_stopped(self, statuses: Sequence[NodeStatus], blamed: Blamed = lambda: None) -> Hung | None:
        """A detached job that its own supervisor stopped as hung (a node's reason says so),
        replayed with the stacks its ranks printed: the ranks to name, among all of them. Known
        only once every node's journal was read."""
        why = next((s.reason for s in statuses if policy.is_hung(s.reason)), None)
        if why is None:
            return None
        self.why = why
        return self._name_stuck(statuses, [r for s in statuses for r in s.plan.ranks], blamed)

    def _name_late(self, statuses: Sequence[NodeStatus], late: list[int]) -> Hung:
        """A start-up hang: the ranks that never began. By their stacks, those outside torch.distributed
        (still importing, loading data) are named first; those already in init_process_group wait for them."""
        outside = [r for r in late if r in self.stacks.collective and self.stacks.collective[r] is None]
        inside = [r for r in late if self.stacks.collective.get(r)]
        named = outside or late
        detail = f" (its stack is in {self.stacks.where.get(named[0], '?')})" if outside else ""
        if outside and inside:
            detail += f"; {policy.rank_list(inside)} {'waits' if len(inside) == 1 else 'wait'} for it " \
                      f"{self.stacks.describe(inside[0])}"
        node = next(s.plan.index for s in statuses if named[0] in s.plan.ranks)
        return Hung(node, named[0], f"job did not start: {policy.not_started(named, self.waited)}{detail}; stacks in the "
                                    f"log above and in runs/{self.job_id}/")

    def _name_stuck(self, statuses: Sequence[NodeStatus], among: list[int] | None = None,
                    blamed: Blamed = lambda: None) -> Hung | None:
        running = among if among is not None else [r for s in self._running(statuses) for r in s.plan.ranks]
        if not running:
            return None
        late = [r for r in self.late_starters if r in running]
        if late:
            return self._name_late(statuses, late)
        odd = [r for r in self.stacks.odd_ones_out() if r in running]
        if odd:
            stuck = odd
            detail = "; ".join(f"rank {r} {self.stacks.describe(r)}" for r in odd[:4])
            others = sorted(set(self.stacks.collective) - set(odd))
            if others:
                detail += f"; the other {len(others)} rank(s) {self.stacks.describe(others[0])}"
        else:
            stuck = sorted(running, key=lambda r: self.rank_last.get(r, 0.0))
            detail = "quietest ranks first: " + ", ".join(map(str, stuck[:8])) + (" ..." if len(stuck) > 8 else "")
        recorded = blamed()
        if recorded is not None and set(recorded[0]) & set(running):
            stuck = [r for r in recorded[0] if r in running]
            detail = f"{policy.rank_list(recorded[0])} {recorded[1]} (Flight Recorder); {detail}"
        node = next(s.plan.index for s in statuses if stuck[0] in s.plan.ranks)
        why = policy.hung_words(self.why)
        return Hung(node, stuck[0], f"{why}; {detail}; "
                                    f"stacks in the log above and in runs/{self.job_id}/")

