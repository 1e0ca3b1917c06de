"""Every field the report reads from a run's folder, with the type and range it must have
(rundata.py applies them). A run's files are written by ddp-up, but they sit in a folder anyone
with the user's rights can change, and a copy may come from elsewhere: the reader trusts no field.
A line whose essential fields are wrong is damaged (left out and counted); any other field of the
wrong type or out of range is dropped (None); texts are cut; how many of each thing is kept is
bounded, so that no file makes a page larger than the run could.
"""

from __future__ import annotations

import math

LARGEST = 1e12  # seconds, rates, MiB, counts: a larger number in a run's file is damage, not data
TEXT_MOST = 2000  # characters of one text field kept (a traceback's line, a reason, a command)
MOST = {"state": 20_000, "attempt": 1_000, "series": 5_000, "points": 1_000, "nodes": 10_000, "gpus": 64,
        "traceback": 400, "command": 1_000, "versions": 100}


def number(value) -> float | int | None:
    """A finite number within LARGEST (a bool is not one), else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
            and abs(value) <= LARGEST:
        return value
    return None


def whole(value) -> int | None:
    return value if isinstance(value, int) and number(value) is not None else None


def text(value) -> str | None:
    """A text field: a string (cut to TEXT_MOST) or a number shown as one; anything else None."""
    if isinstance(value, str):
        return value[:TEXT_MOST]
    return None if number(value) is None else str(value)


def texts(value, most: int) -> list[str] | None:
    """A list of texts (its other items left out), at most ``most``; None if not a list."""
    if not isinstance(value, list):
        return None
    return [t for t in (text(v) for v in value[:most]) if t is not None]


def points(value, width: int) -> list[list] | None:
    """[[t, value, ...], ...]: each point ``width`` long, t a number, each value a number or
    None; at most MOST["points"]. None where any point is not so (the series is damaged)."""
    if not isinstance(value, list) or len(value) > MOST["points"]:
        return None
    kept = []
    for point in value:
        if not isinstance(point, list) or len(point) < width or number(point[0]) is None:
            return None
        values = [number(v) for v in point[:width]]
        if any(v is None and raw is not None for v, raw in zip(values, point)):
            return None
        kept.append(values)
    return kept


# Each kind of timeline line: its essential fields (wrong: the line is damaged) and its others.
FIELD = {"text": text, "number": number, "whole": whole, "texts": lambda v: texts(v, MOST["nodes"])}
KINDS = {
    "run": ({}, {"job": "text", "started": "number", "format": "whole"}),
    "attempt": ({}, {"attempt": "whole", "start": "number", "end": "number", "nodes": "texts", "world_size": "whole",
                     "end_why": "text", "cause": "text", "next": "text"}),
    "state": ({"t": "number"}, {"node": "text", "attempt": "whole", "state": "text", "reason": "text"}),
    "progress": ({"points": 3}, {"rank": "whole", "node": "text", "step": "number", "total": "number", "desc": "text",
                                 "unit": "text", "bar": "text"}),
    "lines": ({"points": 2}, {"rank": "whole", "node": "text", "step": "number"}),
    "gpu": ({"points": 3}, {"node": "text", "gpu": "whole", "total_mib": "number", "step": "number"}),
    "late": ({"points": 2}, {"node": "text", "step": "number"}),
    "end": ({}, {"t": "number", "exit_status": "whole"}),
}


def timeline_line(record) -> dict | None:
    """A timeline line with every field checked (see KINDS), or None where it is damaged."""
    if not isinstance(record, dict) or record.get("kind") not in KINDS:
        return None
    kind = record["kind"]
    needed, others = KINDS[kind]
    kept: dict = {"kind": kind}
    for name, what in needed.items():
        value = points(record.get(name), what) if name == "points" else FIELD[what](record.get(name))
        if value is None:
            return None
        kept[name] = value
    for name, what in others.items():
        kept[name] = FIELD[what](record.get(name))
    return kept


def summary(value: dict) -> dict:
    """summary.json's fields that the page shows, each checked."""
    root = value.get("root_cause")
    nodes = value.get("nodes")
    return {"exit_code": whole(value.get("exit_code")), "interrupted_by": text(value.get("interrupted_by")),
            "started": text(value.get("started")), "ended": text(value.get("ended")),
            "world_size": whole(value.get("world_size")), "master": text(value.get("master")),
            "script": text(value.get("script")), "job_id": text(value.get("job_id")),
            "root_cause": _root_cause(root) if isinstance(root, dict) else None,
            "nodes": [_node(n) for n in nodes[:MOST["nodes"]] if isinstance(n, dict)] if isinstance(nodes, list) else []}


def _root_cause(root: dict) -> dict:
    trace = root.get("traceback")
    return {"host": text(root.get("host")), "node": whole(root.get("node")), "rank": whole(root.get("rank")),
            "what": text(root.get("what")), "exception": text(root.get("exception")),
            "traceback": texts(trace, MOST["traceback"]) if isinstance(trace, list) else
            ([t] if (t := text(trace)) else [])}


def _node(node: dict) -> dict:
    gpus = node.get("gpus")
    kept = {key: text(node.get(key)) for key in ("host", "python", "torch", "cuda", "nccl")}
    kept["node"] = whole(node.get("node"))
    kept["gpus"] = [{"index": whole(g.get("index")), "name": text(g.get("name")), "said": text(g.get("said"))}
                    for g in gpus[:MOST["gpus"]] if isinstance(g, dict)] if isinstance(gpus, list) else []
    return kept


def run(value: dict) -> dict:
    """run.json's fields that the page shows, each checked."""
    git = value.get("git") if isinstance(value.get("git"), dict) else {}
    versions = value.get("versions") if isinstance(value.get("versions"), dict) else {}
    return {"command": texts(value.get("command"), MOST["command"]) or [], "cwd": text(value.get("cwd")),
            "cluster_file": text(value.get("cluster_file")),
            "git": {"commit": text(git.get("commit")), "branch": text(git.get("branch")), "dirty": git.get("dirty") is True},
            "versions": {str(k)[:100]: text(v) for k, v in list(versions.items())[:MOST["versions"]] if text(v)}}
