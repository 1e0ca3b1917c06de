"""Prefixed, colored log lines and the final summary, through one rich Console."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..events import LogLine
from ..job import JobResult, NodeStatus
from ..plan import LaunchPlan, NodePlan

PALETTE = ("cyan", "magenta", "green", "yellow", "blue", "bright_red", "bright_cyan", "bright_magenta",
           "bright_green", "bright_yellow", "bright_blue", "red")
STATE_STYLE = {"done": "green", "failed": "bold red", "lost": "bold red", "error": "bold red",
               "stopped": "yellow", "stopping": "yellow", "running": "cyan"}
SEPARATOR = {"out": "|", "err": "!", "node": "~"}  # stdout, stderr, the node's own diagnostics


def node_color(index: int) -> str:
    return PALETTE[index % len(PALETTE)]


class LinePrefixer:
    """``'gpu-b r5 | '``: label and global rank padded so columns line up across nodes."""

    def __init__(self, plan: LaunchPlan):
        self.label_width = max(len(n.label) for n in plan.nodes)
        self.rank_width = len(str(max(plan.world_size - 1, 0))) + 1

    def __call__(self, node: NodePlan, line: LogLine) -> str:
        rank = f"r{line.rank}" if line.rank is not None else ""
        return f"{node.label:<{self.label_width}} {rank:<{self.rank_width}} {SEPARATOR[line.stream]} "


class ConsoleView:
    """Plain streaming view: one line per log line, a notice per state change that matters."""

    def __init__(self, plan: LaunchPlan, console: Console | None = None):
        self.plan = plan
        self.console = console or Console(highlight=False, soft_wrap=True)
        self.prefix = LinePrefixer(plan)

    def lines(self, node: NodePlan, lines: list[LogLine]) -> None:
        color = node_color(node.index)
        for line in lines:
            text = Text(self.prefix(node, line), style=color)
            text.append(line.text, style="dim" if line.stream == "node" else ("red" if line.stream == "err" else ""))
            self.console.print(text)

    def node_state(self, status: NodeStatus) -> None:
        if status.state in ("failed", "lost", "error"):
            self.notice(f"{status.plan.label}: {status.state}" + (f" ({status.reason})" if status.reason else ""))

    def notice(self, text: str) -> None:
        self.console.print(Text("ddp-up ", style="bold") + Text(text, style="yellow"))

    def intro(self, plan: LaunchPlan) -> None:
        self.notice(f"job {plan.job_id}: {len(plan.nodes)} node(s), world size {plan.world_size}, "
                    f"master {plan.master_addr}:{plan.master_port or 'auto'}")

    def finished(self, result: JobResult) -> None:
        self.console.print(summary_table(result))
        root = result.root_cause
        if root:
            self.console.print(Text("root cause: ", style="bold red") + Text(root.render()))
        verdict = "interrupted" if result.interrupted else ("ok" if result.exit_code == 0 else "FAILED")
        self.notice(f"job {result.plan.job_id} {verdict} after {result.elapsed:.1f} s (exit status {result.exit_code})")


def summary_table(result: JobResult) -> Table:
    table = Table(title=f"job {result.plan.job_id} (master {result.plan.master_addr}:{result.master_port})",
                  title_justify="left")
    for column in ("node", "host", "ranks", "state", "exit", "detail"):
        table.add_column(column)
    for status in result.nodes:
        plan = status.plan
        ranks = f"{plan.ranks.start}-{plan.ranks.stop - 1}" if plan.nproc > 1 else str(plan.ranks.start)
        code = status.signal or ("" if status.exit_code is None else str(status.exit_code))
        table.add_row(str(plan.index), plan.label, ranks,
                      Text(status.state, style=STATE_STYLE.get(status.state, "")), code, status.reason or "")
    return table
