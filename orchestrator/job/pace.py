"""How fast each node goes while the job runs, from the frames that say so: Arrivals (its
collectives: flight.py, stragglers.py) and Bars (its progress bars: progress.py). Each turns into
what the views show and, for a node that falls behind, one notice and one event.
"""

from __future__ import annotations

from ..diagnose.gpuhealth import said_of
from ..diagnose.progress import Bar, ProgressBoard, read
from ..diagnose.rankfailures import node_clock
from ..node.protocol import wire
from .events import LogLine, Reshape


def bars_of(frame: wire.Bars, first_rank: int, nproc: int, mask=lambda text: text) -> list[Bar]:
    """A Bars frame's entries (the node's words: odd ones are skipped), with global ranks and
    secrets masked (``mask``), as a line's are."""
    found = []
    for item in frame.bars if isinstance(frame.bars, list) else ():
        if not (isinstance(item, list) and len(item) == 3 and item[0] in ("out", "err")
                and isinstance(item[1], int) and 0 <= item[1] < nproc and isinstance(item[2], list)):
            continue
        rows = tuple(mask(row[:1000]) for row in item[2][:32] if isinstance(row, str))
        found.append(Bar(item[0], first_rank + item[1], rows))
    return found


class PaceReports:
    """Arrivals and Bars turned into the views' cells, the hang watch's progress and, for a node
    that falls behind, one notice and one event. Holds what it reads and tells, not the Job."""

    def __init__(self, plan, table, view, flight, hang, clock, shown: frozenset[int] | None = None):
        self.plan, self.table, self.view, self.flight, self.hang, self.clock = plan, table, view, flight, hang, clock
        self.board = ProgressBoard([n.ranks for n in plan.nodes], shown)
        self.counts: dict[tuple[int, str], tuple] = {}  # (rank, stream) -> the counts its bars said last
        self.recorded: float | None = None  # the frame in hand's own time (its node's wall clock), where replayed
        self.late_since: dict[int, float] = {}  # the nodes that straggle now, since when without a pause
        self.set_aside = False  # a node was set aside already (one an attempt)

    def frame(self, node: int, frame: wire.Frame) -> None:
        if isinstance(frame, wire.Arrivals):
            self.arrivals(node, frame)
        else:
            self.bars(node, frame)

    def arrivals(self, node: int, frame: wire.Arrivals) -> None:
        skew = self.table[node].clock_skew
        for late in self.flight.arrivals(node, frame.times, lambda at: node_clock(at, skew)):
            self.behind(late.node, late.how())
        self.view.late(self.flight.figures())
        if self.plan.evict_after is None or self.plan.detach:
            return  # no one is set aside (a detached job's supervisor sets its own aside): how long is not kept
        now = self.clock()
        for late in self.flight.figures():
            if late.straggler:
                self.late_since.setdefault(late.node, now)
            else:
                self.late_since.pop(late.node, None)

    def aside(self, now: float) -> Reshape | None:
        """With `evict_after:` (where a spare or min_nodes lets the run do without a node): the
        node that has straggled that long, to set aside at the next attempt, with why: its
        lateness, and what nvidia-smi said of its GPUs at the preflight. At most one an attempt."""
        after = self.plan.evict_after
        due = [n for n, since in self.late_since.items() if now - since >= after and self.table[n].state == "running"]
        if self.set_aside or not due:
            return None
        self.set_aside = True
        status, late = self.table[due[0]], {f.node: f for f in self.flight.figures()}[due[0]]
        said = said_of([status])[str(status.plan.index)]
        return Reshape(f"{status.plan.label} has straggled for {after:g} s ({late.how()}); its GPUs at the preflight: "
                       f"{said}", aside=status.plan.label)

    def bars(self, node: int, frame: wire.Bars) -> None:
        plan = self.table[node].plan
        bars = bars_of(frame, plan.ranks.start, plan.nproc, self.plan.mask if self.plan.secrets else lambda text: text)
        now = self.clock()
        self.hang.moved(self.moved(bars), now)
        self.board.bars(node, bars, now)
        self.view.bars(plan, bars, at=self.recorded)
        running = self.running()
        for slow, share in self.board.newly_slow(running).items():
            self.behind(slow, f"its progress goes at {share} the others' median rate")

    def moved(self, bars: list[Bar]) -> list[int]:
        """The ranks whose bars' counts moved: progress, as a line is. A bar redrawn as it was (rich
        and Lightning redraw on a timer while a collective is stuck), or one with no count, is not."""
        ranks = []
        for bar in bars:
            counts = tuple((r.n, r.total) for r in map(read, bar.rows) if r is not None)
            if counts and counts != self.counts.get((bar.rank, bar.stream)):
                ranks.append(bar.rank)
            self.counts[(bar.rank, bar.stream)] = counts
        return ranks

    def behind(self, node: int, how: str) -> None:
        label = self.table[node].plan.label
        self.view.notice(f"{label} is a straggler: {how}")
        self.view.event("straggler", f"{label} is a straggler: {how}", node=node, host=label)

    def lines(self, node: int, lines: list[LogLine]) -> None:
        self.board.lines(node, lines, self.clock())

    def cells(self, now: float) -> dict[int, tuple[str, str, str]]:
        """{node: (bar, progress, slow)} for the dashboard's rows."""
        slow = self.board.slow(self.running())
        return {n: (*self.board.cells(n, now), slow.get(n, "")) for n in self.board.pace}

    def eta(self, now: float) -> float | None:
        return self.board.eta(now, self.running())

    def running(self) -> list[int]:
        return [s.plan.index for s in self.table if s.state == "running"]
