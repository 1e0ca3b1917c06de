"""The live dashboard: a header and one row per node, redrawn at a bounded rate, with log lines
scrolling above it. ``render`` is a pure function of a JobSnapshot; the view owns the Live."""

from __future__ import annotations

import time

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.style import Style
from rich.table import Table
from rich.text import Text

from ..clean import outside, safe_text
from ..diagnose.outcome import JobResult, JobSnapshot, NodeRow
from ..diagnose.progress import duration
from ..plan.launch import LaunchPlan
from .console import STATE_STYLE, Block, ConsoleView, Ink, node_color

DRAW_INTERVAL = 0.25  # seconds between table redraws (4 Hz)
FLUSH_INTERVAL = 0.1  # seconds between batched log prints above the table
PHASE_STYLE = {"running": "cyan", "connecting": "yellow", "stopping": "yellow", "failing": "bold red",
               "failed": "bold red", "done": "green"}
# States that need a human's eye are listed first when not every node fits on screen.
ATTENTION = {"failed": 0, "lost": 0, "error": 0, "stopping": 1, "stopped": 1, "connecting": 2, "ready": 2,
             "starting": 2, "done": 3, "running": 4}


def render(snap: JobSnapshot, rates: dict[int, float], max_rows: int, mask=lambda text: text,
           width: int | None = None, metric: tuple[str, dict[str, float]] | None = None) -> RenderableType:
    """The live table. Cells that hold what nodes said are Text, never markup, and cleaned.
    ``width``: the terminal's; where it is narrow, the least needed columns go (DROPPED_FIRST)
    and the last line and progress are cut, while node, host, ranks and state stay whole."""
    header = Text.assemble(("ddp-up ", "bold"), f"job {snap.job_id}  master {snap.master}  "
                           f"world {snap.world_size}  elapsed {duration(snap.elapsed)}  ",
                           (snap.phase, PHASE_STYLE.get(snap.phase, "")),
                           f"  attempt {snap.attempt}" if snap.attempt else "",
                           f"  eta {duration(snap.eta)}" if snap.eta is not None else "",
                           (f"  out: {', '.join(snap.quarantined)}" if snap.quarantined else "", "red"))
    shown, hidden = _pick_rows(snap.nodes, max_rows)
    columns = _columns(snap.nodes, shown, rates, mask)
    if metric is not None:  # the run's first metric, each node's first rank's latest (metricsfile.MetricsFile.shown)
        name, values = metric
        cells = ["" if values.get(r.label) is None else f"{values[r.label]:.4g}" for r in shown]
        columns = {**{k: v for k, v in columns.items() if k not in GIVES_WAY}, safe_text(mask(name))[:24]: ("right", cells),
                   **{k: v for k, v in columns.items() if k in GIVES_WAY}}
    for name in DROPPED_FIRST:
        if width is None or _fixed_width(columns) <= width - LAST_LINE_LEAST:
            break
        columns.pop(name, None)
    table = Table(box=None, pad_edge=False, expand=False, show_edge=False)
    for name, (justify, _) in columns.items():
        # rich narrows the columns that may wrap first: only those that give way may, and their
        # cells never wrap (one_line), so they are cut with an ellipsis
        cut = name in GIVES_WAY
        table.add_column(one_line(name) if cut else name, justify=justify, no_wrap=not cut, overflow="ellipsis",
                         max_width=60 if name == "last line" else None, style="dim" if name == "last line" else None)
    for i in range(len(shown)):
        table.add_row(*(cells[i] for _, cells in columns.values()))
    parts: list[RenderableType] = [header, table]
    if hidden:
        counts: dict[str, int] = {}
        for row in hidden:
            counts[row.state] = counts.get(row.state, 0) + 1
        parts.append(Text(f"+{len(hidden)} more nodes: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())),
                          style="dim"))
    return Group(*parts)


GIVES_WAY = ("progress", "last line")  # the columns cut to fit a narrow terminal; the rest stay whole
DROPPED_FIRST = ("lines/s", "lines", "up", "late", "gpu", "exit")  # in a narrow terminal, in this order
LAST_LINE_LEAST = 30  # columns the last line (and progress) keep before another column goes


def _columns(nodes, shown, rates, mask) -> dict[str, tuple[str, list]]:
    """{column: (justify, its cells for the rows shown)}, in order; gpu, late and progress only
    where some node has them (the agents sample GPUs, a node straggles, a bar says how far)."""
    columns = {
        "node": ("right", [str(r.index) for r in shown]),
        "host": ("left", [outside(r.label, style=node_color(r.index)) for r in shown]),
        "ranks": ("left", [_ranks(r.ranks) for r in shown]),
        "state": ("left", [Text(r.state, style=STATE_STYLE.get(r.state, "")) for r in shown]),
        "up": ("right", ["" if r.uptime is None else duration(r.uptime) for r in shown]),
        "lines": ("right", [str(r.lines) for r in shown]),
        "lines/s": ("right", [f"{rates.get(r.index, 0.0):.0f}" for r in shown]),
        "exit": ("right", [r.exit for r in shown]),
        "gpu": ("right", [r.gpus for r in shown]),
        "late": ("left", [Text(r.late, style="yellow") for r in shown]),
        "progress": ("left", [_progress(r) for r in shown]),
        "last line": ("left", [one_line(safe_text(mask(r.reason or r.bar or r.last_line))) for r in shown]),
    }
    for name, field in (("gpu", "gpus"), ("late", "late"), ("progress", "progress")):
        if not any(getattr(r, field) for r in nodes):
            del columns[name]
    return columns


def _fixed_width(columns) -> int:
    """What the columns that stay whole take: their widest cell or name, and a space between."""
    return sum(max([len(name)] + [len(str(c)) for c in cells]) + 2
               for name, (_, cells) in columns.items() if name not in GIVES_WAY)


def one_line(text: str | Text) -> Text:
    """A cell of a column that gives way: cut with an ellipsis, never wrapped onto a second line."""
    cell = Text(text) if isinstance(text, str) else text
    cell.no_wrap, cell.overflow = True, "ellipsis"
    return cell


def _progress(row: NodeRow) -> Text:
    """``45% 36.2it/s eta 0:15``, and ``slow 0.61x`` where the node goes well below the others."""
    return one_line(Text(row.progress) + (Text(f" slow {row.slow}", style="bold yellow") if row.slow else Text("")))


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
        self.metric = lambda: None  # the run's first metric, as metricsfile.MetricsFile.shown gives it

    def bars(self, node, bars, at=None) -> None:
        pass  # the table shows them, in place

    def emit(self, block: Block) -> None:
        self.pending.parts.extend(block.parts)  # printed at the next flush: one Live redraw per batch

    def notice(self, text: str) -> None:
        if not self.started:  # before or after the live table: print straight away
            return super().notice(text)
        self.pending.add(self._bold(f"{self.prog} ") + self._notice_ink(safe_text(self.plan.mask(text))) + "\n")

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
        self.live.update(render(snap, self.rates, max_rows, self.plan.mask, self.console.size.width, self.metric()),
                         refresh=True)

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
