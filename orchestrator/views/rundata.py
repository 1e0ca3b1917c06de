"""A run's folder as its report reads it (report.py, charts.py): the timeline (timeline.py), the
summary (summary.json) and what ran (run.json), each read whole and bounded, as a regular file
only; what is missing or damaged is named, and the page shows the rest.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from ..node.local.state import read_regular
from .timeline import NAME as TIMELINE

READ_MOST = 64 << 20  # bytes of one file read: the timeline stays within a few MB
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

    def kind(self, kind: str) -> list[dict]:
        return [r for r in self.records if r.get("kind") == kind]


def load(where: str) -> RunData:
    """The folder's files, each read whole and bounded, as regular files only (never through a
    link); one missing or damaged is named in ``missing``, and the page shows the rest."""
    data = RunData(job_id=os.path.basename(os.path.abspath(where)))
    raw, why = read_regular(os.path.join(where, TIMELINE), READ_MOST)
    if raw is None:
        data.missing.append(f"{TIMELINE}: {why} (no charts over time)")
    else:
        for line in raw.decode("utf-8", "replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut short by a crash mid-write (written whole and renamed: rare)
            if isinstance(record, dict):
                data.records.append(record)
        if not data.kind("end"):
            data.missing.append("the run's last moments: its timeline was cut short (the controller was "
                                "stopped or killed before the run's end); the page shows what it kept")
    for name in ("summary.json", "run.json"):
        raw, why = read_regular(os.path.join(where, name), READ_MOST)
        try:
            value = json.loads(raw) if raw is not None else None
        except ValueError:
            value, why = None, "not JSON"
        if not isinstance(value, dict):
            data.missing.append(f"{name}: {why or 'not a record'}")
            value = None
        setattr(data, name.partition(".")[0], value)
    run = data.kind("run")
    data.job_id = str((run[0].get("job") if run else None) or (data.summary or {}).get("job_id") or data.job_id)
    return data
