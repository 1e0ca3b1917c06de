"""The live dashboard: a header and one row per node, redrawn at a bounded rate, with log lines
scrolling above it. ``render`` is a pure function of a JobSnapshot; the view owns the Live."""

from __future__ import annotations

import time

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.style import Style
from rich.table import Table
from rich.text import Text

from ..outcome import JobResult, JobSnapshot, NodeRow
from ..plan import LaunchPlan
from ..progress import duration
from .console import STATE_STYLE, Block, ConsoleView, Ink, node_color, outside, safe_text

DRAW_INTERVAL = 0.25  # seconds between table redraws (4 Hz)
FLUSH_INTERVAL = 0.1  # seconds between batched log prints above the table
PHASE_STYLE = {"running": "cyan", "connecting": "yellow", "stopping": "yellow", "failing": "bold red",
               "failed": "bold red", "done": "green"}
# States that need a human's eye are listed first when not every node fits on screen.
ATTENTION = {"failed": 0, "lost": 0, "error": 0, "stopping": 1, "stopped": 1, "connecting": 2, "ready": 2,
             "starting": 2, "done": 3, "running": 4}


def render(snap: JobSnapshot, rates: dict[int, float], max_rows: int, mask=lambda text: text) -> RenderableType:
    """The live table. Cells that hold what nodes said are Text, never markup, and cleaned."""
    header = Text.assemble(("ddp-up ", "bold"), f"job {snap.job_id}  master {snap.master}  "
                           f"world {snap.world_size}  elapsed {duration(snap.elapsed)}  ",
                           (snap.phase, PHASE_STYLE.get(snap.phase, "")),
                           f"  attempt {snap.attempt}" if snap.attempt else "",
                           f"  eta {duration(snap.eta)}" if snap.eta is not None else "",
                           (f"  out: {', '.join(snap.quarantined)}" if snap.quarantined else "", "red"))
    table = Table(box=None, pad_edge=False, expand=False, show_edge=False)
    gpus = any(row.gpus for row in snap.nodes)  # the column only where the agents sample GPUs
    late = any(row.late for row in snap.nodes)  # and only while a node straggles
    progress = any(row.progress for row in snap.nodes)  # and only where a bar says how far
    for name, justify in (("node", "right"), ("host", "left"), ("ranks", "left"), ("state", "left"),
                          ("up", "right"), ("lines", "right"), ("lines/s", "right"), ("exit", "right"),
                          *((("gpu", "right"),) if gpus else ()), *((("late", "left"),) if late else ()),
                          *((("progress", "left"),) if progress else ()),
                          ("last line", "left")):
        table.add_column(name, justify=justify, no_wrap=True, overflow="ellipsis",
                         max_width=60 if name == "last line" else None, style="dim" if name == "last line" else None)
    shown, hidden = _pick_rows(snap.nodes, max_rows)
    for row in shown:
        table.add_row(str(row.index), outside(row.label, style=node_color(row.index)), _ranks(row.ranks),
                      Text(row.state, style=STATE_STYLE.get(row.state, "")),
                      "" if row.uptime is None else duration(row.uptime), str(row.lines),
                      f"{rates.get(row.index, 0.0):.0f}", row.exit, *((row.gpus,) if gpus else ()),
                      *((Text(row.late, style="yellow"),) if late else ()),
                      *((_progress(row),) if progress else ()),
                      Text(safe_text(mask(row.reason or row.bar or row.last_line))))
    parts: list[RenderableType] = [header, table]
    if hidden:
        counts: dict[str, int] = {}
        for row in hidden:
            counts[row.state] = counts.get(row.state, 0) + 1
        parts.append(Text(f"+{len(hidden)} more nodes: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())),
                          style="dim"))
    return Group(*parts)


def _progress(row: NodeRow) -> Text:
    """``45% 36.2it/s eta 0:15``, and ``slow 0.61x`` where the node goes well below the others."""
    return Text(row.progress) + (Text(f" slow {row.slow}", style="bold yellow") if row.slow else Text(""))


def _pick_rows(rows: tuple[NodeRow, ...], max_rows: int) -> tuple[list[NodeRow], list[NodeRow]]:
    if len(rows) <= max_rows:
        return list(rows), []
    ranked = sorted(rows, key=lambda r: (ATTENTION.get(r.state, 5), r.index))
    shown = sorted(ranked[:max_rows], key=lambda r: r.index)
    return shown, ranked[max_rows:]


def _ranks(ranks: range) -> str:
    return f"{ranks.start}-{ranks.stop - 1}" if len(ranks) > 1 else str(ranks.start)


class DashboardView(ConsoleView):
    """ConsoleView whose lines are batched above a live table; the table is redrawn at most 4x/s."""

    def __init__(self, plan: LaunchPlan, console: Console | None = None, **kwargs):
        super().__init__(plan, console, **kwargs)
        self.live = Live(console=self.console, auto_refresh=False, transient=True,
                         redirect_stdout=False, redirect_stderr=False)
        self.pending = Block()
        self._notice_ink = Ink(self.console, Style(color="yellow"))
        self.last_flush = self.last_draw = 0.0
        self.samples: dict[int, tuple[float, int]] = {}
        self.rates: dict[int, float] = {}
        self.started = False

    def bars(self, node, bars) -> None:
        pass  # the table shows them, in place

    def emit(self, block: Block) -> None:
        self.pending.parts.extend(block.parts)  # printed at the next flush: one Live redraw per batch

    def notice(self, text: str) -> None:
        if not self.started:  # before or after the live table: print straight away
            return super().notice(text)
        self.pending.add(self._bold("ddp-up ") + self._notice_ink(safe_text(self.plan.mask(text))) + "\n")

    def intro(self, plan: LaunchPlan) -> None:
        super().intro(plan)
        self.live.start()
        self.started = True

    def tick(self, snapshot) -> None:
        super().tick(snapshot)
        now = time.monotonic()
        if self.pending and now - self.last_flush >= FLUSH_INTERVAL:
            self._flush()
        if self.started and now - self.last_draw >= DRAW_INTERVAL:
            self.draw(snapshot())

    def draw(self, snap: JobSnapshot) -> None:
        self.last_draw = time.monotonic()
        for row in snap.nodes:
            t0, n0 = self.samples.get(row.index, (snap.now, row.lines))
            if snap.now - t0 >= 1.0 or row.index not in self.samples:
                self.rates[row.index] = (row.lines - n0) / (snap.now - t0) if snap.now > t0 else 0.0
                self.samples[row.index] = (snap.now, row.lines)
        max_rows = max(4, self.console.size.height // 2 - 4)
        self.live.update(render(snap, self.rates, max_rows, self.plan.mask), refresh=True)

    def _flush(self) -> None:
        self.last_flush = time.monotonic()
        if self.pending:
            block, self.pending = self.pending, Block()
            self.console.print(block, end="")

    def close(self) -> None:
        self.end_lines()
        self._flush()
        if self.started:
            self.live.stop()
            self.started = False

    def finished(self, result: JobResult, attempts=()) -> None:
        self.close()
        super().finished(result, attempts)
