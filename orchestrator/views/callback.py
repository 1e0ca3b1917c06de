"""The Python API's ``on_line``: every line of the job, as a value, to the caller's function.

The lines are those the run logs keep (every rank, unfiltered), secrets already masked, terminal
escapes and controls removed. A callback that raises is told of once and not called again: the
caller's code never stops the job or its cleanup.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from ..clean import safe_text
from ..job.events import LogLine
from ..plan.launch import NodePlan


class Line(NamedTuple):
    host: str  # the node, as the cluster file names it
    node: int
    rank: int | None  # global rank; None for the launcher or the node itself
    stream: str  # "out", "err", or "node" (the node's own diagnostics)
    text: str


class LineCallback:
    def __init__(self, on_line: Callable[[Line], None], warn: Callable[[str], None]):
        self.on_line, self.warn = on_line, warn
        self.dropped = False

    def lines(self, node: NodePlan, lines: list[LogLine]) -> None:
        if self.dropped:
            return
        for line in lines:
            try:
                self.on_line(Line(node.label, node.index, line.rank, line.stream, safe_text(line.text)))
            except Exception as e:  # noqa: BLE001 - the caller's code: any error is theirs, told once
                self.dropped = True
                self.warn(f"on_line raised {type(e).__name__}: {e}; it is not called again (the job goes on)")
                return
