"""A run's folder as its report reads it (report.py, charts.py): the timeline (timeline.py), the
summary (summary.json) and what ran (run.json), each read whole and bounded, as a regular file
only; what is missing or damaged is named, and the page shows the rest.
"""

from __future__ import annotations

import html
import json
import os
from collections import Counter
from dataclasses import dataclass, field

from ..clean import BIDI
from ..node.local.state import read_regular
from . import runfields
from .metriccharts import read_rows
from .timeline import NAME as TIMELINE

READ_MOST = 64 << 20  # bytes of one file read: the timeline stays within a few MB
LOSSES_NAMED = 50  # a node's loss named on the page, each: past these, how many more
STATE_COLORS = {"connecting": "#c7c7c7", "ready": "#9ecae1", "starting": "#6baed6", "running": "#31a354",
                "stopping": "#fd8d3c", "done": "#3182bd", "failed": "#de2d26", "hung": "#a50f15", "lost": "#756bb1",
                "stopped": "#969696", "error": "#e7298a"}


@dataclass
class RunData:
    """What a run's folder holds for its report, and what it lacks."""

    job_id: str = "?"
    records: list = field(default_factory=list)  # the timeline's lines
    summary: dict | None = None
    run: dict | None = None
    missing: list = field(default_factory=list)  # what the page says it could not show, and why
    metrics: list = field(default_factory=list)  # metrics.csv's rows (metriccharts.Row)

    def kind(self, kind: str) -> list[dict]:
        return [r for r in self.records if r.get("kind") == kind]


def esc(value) -> str:
    """Any text of the run's (a traceback, a host, a bar's description) for the page: escaped,
    for its own HTML and for a chart's labels and hover text alike (Plotly reads a few tags there)."""
    return html.escape("" if value is None else str(value)).translate(BIDI)


def group(record: dict) -> str:
    """Which of runfields.MOST bounds a timeline line: states, attempts, or series (the rest)."""
    kind = record["kind"]
    return kind if kind in ("state", "attempt") else "series"


def load(where: str) -> RunData:
    """The folder's files, each read whole and bounded, as regular files only (never through a
    link); one missing or damaged is named in ``missing``, and the page shows the rest."""
    data = RunData(job_id=os.path.basename(os.path.abspath(where)))
    raw, why = read_regular(os.path.join(where, TIMELINE), READ_MOST)
    if raw is None:
        data.missing.append(f"{TIMELINE}: {why} (no charts over time)")
    else:
        damaged, over, kept = 0, Counter(), Counter()
        for line in raw.decode("utf-8", "replace").splitlines():
            try:
                record = runfields.timeline_line(json.loads(line))
            except (ValueError, RecursionError):  # cut short (a crash mid-write), damaged, or nested past reason
                record = None
            if record is None:
                damaged += 1
            elif kept[group(record)] >= runfields.MOST[group(record)]:
                over[group(record)] += 1
            else:
                kept[group(record)] += 1
                data.records.append(record)
        if damaged:
            data.missing.append(f"{damaged} damaged line(s) of {TIMELINE}, left out")
        for what, count in over.items():
            data.missing.append(f"{count} {what} line(s) of {TIMELINE} past the first {runfields.MOST[what]:,}, left out")
        if not data.kind("end"):
            data.missing.append("the run's end: its timeline has none yet (the run still goes on, or ddp-up was "
                                "killed before the end); the page shows what was kept, written every 30 s")
    for name in ("summary.json", "run.json"):
        raw, why = read_regular(os.path.join(where, name), READ_MOST)
        try:
            value = json.loads(raw) if raw is not None else None
        except (ValueError, RecursionError):
            value, why = None, "not JSON"
        if not isinstance(value, dict):
            data.missing.append(f"{name}: {why or 'not a record'}")
            value = None
        checked = runfields.summary if name == "summary.json" else runfields.run
        setattr(data, name.partition(".")[0], None if value is None else checked(value))
    losses = [s for s in data.kind("state") if s.get("state") == "lost"]
    for lost in losses[:LOSSES_NAMED]:
        data.missing.append(f"{lost.get('node')}: lost at {lost.get('t')} s (attempt {lost.get('attempt')}); "
                            "nothing of it after that in that attempt")
    if len(losses) > LOSSES_NAMED:
        data.missing.append(f"{len(losses) - LOSSES_NAMED} more node(s) lost, with nothing of them after that")
    data.metrics = read_rows(where, data.missing)
    run = data.kind("run")
    data.job_id = str((run[0].get("job") if run else None) or (data.summary or {}).get("job_id") or data.job_id)
    return data
