"""Prefixed, colored log lines and the final summary, through one rich Console."""

from __future__ import annotations

import io
import time

from rich.console import Console, ConsoleOptions, RenderResult
from rich.segment import Segment
from rich.style import Style
from rich.table import Table
from rich.text import Text

from ..clean import outside, safe_text
from ..diagnose.outcome import JobResult, NodeStatus
from ..diagnose.progress import Bar, Snapshots, chosen_rank
from ..job.events import LogLine
from ..plan.launch import LaunchPlan, NodePlan
from .filters import Collapser, format_ranks

PALETTE = ("cyan", "magenta", "green", "yellow", "blue", "bright_red", "bright_cyan", "bright_magenta",
           "bright_green", "bright_yellow", "bright_blue", "red")
STATE_STYLE = {"done": "green", "failed": "bold red", "lost": "bold red", "error": "bold red",
               "stopped": "yellow", "stopping": "yellow", "running": "cyan"}
SEPARATOR = {"out": "|", "err": "!", "node": "~"}  # stdout, stderr, the node's own diagnostics



DISPLAY_MAX = 10_000  # characters of one line the console shows; the log files keep every byte


def node_color(index: int) -> str:
    return PALETTE[index % len(PALETTE)]


class Ink:
    """A style's escape codes as this console writes them (none when it has no colors),
    rendered once, so styling a log line is a string concatenation."""

    _PROBE = "\ue000"  # a private-use character: never part of an escape code

    def __init__(self, console: Console, style: Style | None):
        if style is None:
            self.open = self.close = ""
            return
        # On a console of its own with the same colors: the view's may hold a Live (the dashboard,
        # at a restart), whose hook adds its frame to whatever goes through that console, a
        # capture too; every line then ended with the dashboard's old frame.
        scratch = Console(file=io.StringIO(), color_system=console.color_system, force_terminal=console.is_terminal,
                          no_color=console.no_color, legacy_windows=console.legacy_windows)
        with scratch.capture() as captured:
            scratch.print(Text(self._PROBE, style=style), end="")
        self.open, _, self.close = captured.get().partition(self._PROBE)

    def __call__(self, text: str) -> str:
        return f"{self.open}{text}{self.close}"


class Block:
    """Log lines already styled, written by rich as one segment: no per-line markup or wrapping.

    Building a rich ``Text`` per log line costs ~40 us and a segment per piece a few us; a
    print-heavy job made that the controller's bottleneck. One string per batch still goes
    through the Console (and so through Live, which keeps the dashboard below it).
    """

    def __init__(self) -> None:
        self.parts: list[str] = []

    def add(self, text: str) -> None:
        self.parts.append(text)

    def __bool__(self) -> bool:
        return bool(self.parts)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield Segment("".join(self.parts))


class LinePrefixer:
    """``'gpu-b r5 | '``: label and global rank padded so columns line up across nodes."""

    def __init__(self, plan: LaunchPlan):
        self.label_width = max(len(n.label) for n in plan.nodes)
        self.rank_width = len(str(max(plan.world_size - 1, 0))) + 1

    def __call__(self, node: NodePlan, rank: int | None, stream: str) -> str:
        shown = f"r{rank}" if rank is not None else ""
        return f"{node.label:<{self.label_width}} {shown:<{self.rank_width}} {SEPARATOR[stream]} "


class ConsoleView:
    """Plain streaming view: prefixed lines as they arrive, a notice per state change that matters.

    ``ranks`` limits which ranks' lines are shown; ``collapse`` merges a line that every rank
    printed into one. Both only affect the console: the run's log files keep every line.
    """

    def __init__(self, plan: LaunchPlan, console: Console | None = None, ranks: frozenset[int] | None = None,
                 collapse: bool = False, clock=time.monotonic, prog: str = "ddp-up"):
        self.console = console or Console(highlight=False, soft_wrap=True)
        self.prog = prog  # the command whose notices these are (ddp-attach, ddp-logs follow a job too)
        self.ranks = ranks
        self.collapse = collapse
        self.clock = clock
        self._text_ink = {stream: Ink(self.console, style) for stream, style in _TEXT_STYLE.items()}
        self._bold = Ink(self.console, _BOLD)
        self._for_plan(plan)

    def _for_plan(self, plan: LaunchPlan) -> None:
        """What depends on the nodes and ranks: set at the start, and again at a restart."""
        self.plan = plan
        self.prefix = LinePrefixer(plan)
        self.collapser = Collapser(plan.world_size) if self.collapse else None
        self._prefixes: dict[tuple, str] = {}
        self._node_ink = [Ink(self.console, Style.parse(node_color(n.index))) for n in plan.nodes]
        self._cut: dict[tuple, list] = {}  # (node, rank, stream) of a huge line being shown: [node, characters left out]
        self._bar_shown = Snapshots()  # by (node, stream)
        self._bar_replayed = Snapshots()  # the same, on the nodes' recorded clock (a replay's)

    # A view owns its lifecycle, as rich's Live does: ``with view:`` prints the intro (and starts
    # a live display), leaving gives the terminal back, whatever happened in between.

    def __enter__(self) -> ConsoleView:
        self.intro(self.plan)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def lines(self, node: NodePlan, lines: list[LogLine]) -> None:
        out = Block()
        now = self.clock()
        for line in lines:
            if line.rank is not None and self.ranks is not None and line.rank not in self.ranks:
                continue
            if self._in_snapshot(node, line):
                continue
            if line.more or len(line.text) > DISPLAY_MAX or (self._cut and (node.index, line.rank, line.stream)
                                                                  in self._cut):
                self._long_line(out, node, line, (node.index, line.rank, line.stream))
                continue
            if line.rank is not None and self.collapser is not None and line.stream != "node":
                for stream, ranks, text in self.collapser.add(line.stream, line.rank, line.text, now):
                    self._collapsed(out, stream, ranks, text)
                continue
            out.add(self._prefix(node, line.rank, line.stream))
            out.add(self._text_ink[line.stream](safe_text(line.text)) + "\n")
        self.emit(out)

    def bars(self, node: NodePlan, bars: list[Bar], at: float | None = None) -> None:
        """A snapshot of the node's bar (its chosen rank's) as lines, at most every BAR_EVERY
        seconds (of ``at``, the time the node recorded them, for a replay); its final state comes
        as the line the rank ends it with."""
        out, chosen = Block(), chosen_rank(node.ranks, self.ranks)
        shown, now = (self._bar_shown, self.clock()) if at is None else (self._bar_replayed, at)
        for bar in bars:
            if bar.rank != chosen or not bar.rows or not shown.due((node.index, bar.stream), now):
                continue
            for row in bar.rows:  # one line per row, as a terminal shows them (an epoch's bar over a step's)
                out.add(self._prefix(node, bar.rank, bar.stream))
                out.add(self._text_ink[bar.stream](safe_text(row)) + "\n")
            shown.wrote((node.index, bar.stream), bar.rank, bar.rows)
        self.emit(out)

    def _in_snapshot(self, node: NodePlan, line: LogLine) -> bool:
        """Whether the line was shown already, as a row of the bar's last snapshot (Snapshots)."""
        if line.rank is None or line.more:
            return False
        key = (node.index, line.stream)
        return self._bar_shown.written(key, line.rank, line.text) or self._bar_replayed.written(key, line.rank, line.text)

    def event(self, kind: str, text: str, **fields) -> None:
        pass  # what an event says was noticed on the screen already

    def _long_line(self, out: Block, node: NodePlan, line: LogLine, key: tuple) -> None:
        """The start of a huge line (it may arrive in pieces) on a terminal line of its own, then,
        when the line ends, one marker saying how much of it the terminal was spared; the log
        files keep all of it."""
        cut = self._cut.get(key)
        if cut is None:
            out.add(self._prefix(node, line.rank, line.stream))
            out.add(self._text_ink[line.stream](safe_text(line.text[:DISPLAY_MAX])) + "\n")
            cut = self._cut[key] = [node, 0]
            cut[1] = len(line.text) - min(len(line.text), DISPLAY_MAX)
        else:
            cut[1] += len(line.text)
        if not line.more:
            self._end_cut(out, key)

    def _end_cut(self, out: Block, key: tuple) -> None:
        node, left = self._cut.pop(key)
        _, rank, stream = key
        if left:
            where = f"rank{rank}.log" if rank is not None else f"node{node.index}-*.log"
            out.add(self._prefix(node, rank, stream))
            out.add(self._bold(f"... [{left:,} more characters of that line not shown; the whole line is in {where}]")
                    + "\n")

    def _prefix(self, node: NodePlan, rank: int | None, stream: str) -> str:
        """The styled prefix, made once per (node, rank, stream)."""
        key = (node.index, rank, stream)
        text = self._prefixes.get(key)
        if text is None:
            text = self._prefixes[key] = self._node_ink[node.index](self.prefix(node, rank, stream))
        return text

    def _collapsed(self, out: Block, stream: str, ranks: frozenset[int], text: str) -> None:
        if len(ranks) == 1:
            node = next(n for n in self.plan.nodes if min(ranks) in n.ranks)
            out.add(self._prefix(node, min(ranks), stream))
        else:
            who = f"r{format_ranks(ranks)}" + (" (all)" if len(ranks) == self.plan.world_size else f" ({len(ranks)})")
            out.add(self._bold(f"{'*':<{self.prefix.label_width}} {who} {SEPARATOR[stream]} "))
        out.add(self._text_ink[stream](safe_text(text)) + "\n")

    def emit(self, block: Block) -> None:
        """Write lines now: one Console call per batch."""
        if block:
            self.console.print(block, end="")

    def tick(self, snapshot) -> None:
        self.flush_collapsed(everything=False)

    def flush_collapsed(self, everything: bool = True) -> None:
        """Print held lines whose collapse window has passed (or all of them, at the end)."""
        if self.collapser is not None:
            out = Block()
            for stream, ranks, text in self.collapser.due(self.clock(), everything=everything):
                self._collapsed(out, stream, ranks, text)
            self.emit(out)

    def close(self) -> None:
        self.end_lines()

    def end_lines(self) -> None:
        """Print what is held: collapsed lines, and the markers of huge lines that never ended
        (a stream's unterminated end)."""
        self.flush_collapsed()
        out = Block()
        for key in list(self._cut):
            self._end_cut(out, key)
        self.emit(out)

    def node_state(self, status: NodeStatus) -> None:
        if status.state in ("failed", "lost", "error"):
            self.notice(f"{status.plan.label}: {status.state}" + (f" ({status.reason})" if status.reason else ""))

    def notice(self, text: str) -> None:
        self.console.print(Text(f"{self.prog} ", style="bold") + Text(safe_text(self.plan.mask(text)), style="yellow"))

    def intro(self, plan: LaunchPlan) -> None:
        self.notice(f"job {plan.job_id}: {len(plan.nodes)} node(s), world size {plan.world_size}, "
                    f"master {plan.master_addr}:{plan.master_port or 'auto'}")

    def attempt(self, plan: LaunchPlan) -> None:
        """A restart (attempts.py): the next attempt's nodes from here on (a spare may have joined),
        and its master where it moved (its node out of the run, or back)."""
        moved = plan.master_addr != self.plan.master_addr
        self._for_plan(plan)
        out = f"; out of the run: {', '.join(plan.quarantined)}" if plan.quarantined else ""
        master = f"; master {plan.master_addr}" if moved else ""
        self.notice(f"attempt {plan.attempt}: {len(plan.nodes)} node(s) ({', '.join(n.label for n in plan.nodes)}), "
                    f"world size {plan.world_size}{master}{out}")

    def finished(self, result: JobResult, attempts=()) -> None:
        self.close()
        self.console.print(summary_table(result, self.plan.mask))
        if len(attempts) > 1:
            for a in attempts:
                self.console.print(Text(f"attempt {a.number} ", style="bold") +
                                   Text(f"({len(a.nodes)} node(s), world size {a.world_size})", style="dim") +
                                   Text(": ", style="bold") + attempt_text(a, self.plan.mask))
        root = result.root_cause
        if root:
            self.console.print(Text("root cause: ", style="bold red") + Text(safe_text(self.plan.mask(root.render()))))
        if result.collectives is not None:
            self.console.print(Text("collectives: ", style="bold red") + Text(safe_text(self.plan.mask(result.collectives.text))))
        for late in result.lateness:
            if late.straggler:
                self.console.print(Text("straggler: ", style="bold yellow") + outside(
                    f"{result.plan.rank_node(late.rank)} (node {late.node}, rank {late.rank}): {late.text()}"))
        self.notice(result.ending(attempts))


GROWN = ("stopped to grow",)  # attempts.ENDS that are no failure of the job's


def attempt_text(record, mask) -> Text:
    """One attempt in the final summary: its root cause, why it ended and what came next."""
    if record.end == "succeeded":
        return Text("ok", style="green")
    if record.root_cause is None and record.end in GROWN:  # no failure: the run chose to stop it
        return Text(record.end, style="yellow") + Text(f" (then {safe_text(mask(record.next or ''))})", style="dim")
    how = "; then ".join(part for part in (record.end, record.next) if part)
    return Text(safe_text(mask(record.root_cause or record.end)), style="red") + Text(f" ({safe_text(mask(how))})",
                                                                                        style="dim")


_TEXT_STYLE = {"out": None, "err": Style(color="red"), "node": Style(dim=True)}
_BOLD = Style(bold=True)


def summary_table(result: JobResult, mask=lambda text: text) -> Table:
    table = Table(title=outside(f"job {result.plan.job_id} (master {result.master_text})"), title_justify="left")
    for column in ("node", "host", "ranks", "state", "exit", "detail"):
        table.add_column(column)
    for status in result.nodes:
        plan = status.plan
        ranks = f"{plan.ranks.start}-{plan.ranks.stop - 1}" if plan.nproc > 1 else str(plan.ranks.start)
        code = status.signal or ("" if status.exit_code is None else str(status.exit_code))
        table.add_row(str(plan.index), outside(plan.label), ranks,
                      Text(status.state, style=STATE_STYLE.get(status.state, "")), code,
                      Text(safe_text(mask(status.detail))))
    return table
