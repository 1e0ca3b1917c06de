"""Runs side by side: ``ddp-report JOB JOB ...`` makes one page that compares them. Each metric's
curves of every run on one chart (a run's one rank, or the median of its ranks with their spread,
on the step axis), and a table of what differed between them: the cluster file's settings, the
command and its arguments, the commit, the versions, the world sizes, how each ended. Read as the run's own page reads its folder
(rundata.py: each file bounded, checked, a regular file only); every text escaped.
"""

from __future__ import annotations

import os

import yaml

from ..node.local.state import read_regular
from .metriccharts import CHARTS_MOST, series, spread
from .rundata import RunData, esc, load

CLUSTER_COPY = "cluster.yaml"  # the cluster file as the run read it (run/record.py keeps it)
CLUSTER_MOST = 1 << 20  # bytes of it read
KEYS_MOST = 500  # settings compared


def settings_of(where: str) -> dict[str, str]:
    """The run's cluster file as flat settings ({"nodes[0].host": "a", "restarts": "3"}), or {}."""
    raw, _ = read_regular(os.path.join(where, CLUSTER_COPY), CLUSTER_MOST)
    try:
        value = yaml.safe_load(raw) if raw is not None else None
    except (yaml.YAMLError, RecursionError, ValueError):
        return {}
    flat: dict[str, str] = {}

    def walk(prefix: str, item) -> None:
        if len(flat) >= KEYS_MOST:
            return
        if isinstance(item, dict):
            for key, sub in item.items():
                walk(f"{prefix}.{key}" if prefix else str(key), sub)
        elif isinstance(item, list):
            for i, sub in enumerate(item):
                walk(f"{prefix}[{i}]", sub)
        else:
            flat[prefix] = str(item)[:200]

    walk("", value if isinstance(value, dict) else {})
    return flat


def facts_of(where: str, data: RunData) -> dict[str, str]:
    """What is compared of one run: its settings, command, commit, versions, world sizes, end."""
    run, summary = data.run or {}, data.summary or {}
    facts = {f"cluster file: {k}": v for k, v in settings_of(where).items()}
    git = run.get("git") or {}
    facts["command"] = " ".join(map(str, run.get("command") or []))
    facts["commit"] = f"{git.get('commit') or '?'}{' (with changes)' if git.get('dirty') else ''}"
    facts.update({f"version: {k}": str(v) for k, v in (run.get("versions") or {}).items()})
    worlds = [a.get("world_size") for a in data.kind("attempt")]
    facts["world sizes"] = " → ".join(map(str, worlds)) or str(summary.get("world_size") or "unknown")
    status = summary.get("exit_code")
    facts["ended"] = "ok" if status == 0 else f"failed (exit status {status})" if status is not None else "unknown"
    return facts


def differences(facts: list[dict[str, str]]) -> tuple[list[str], int]:
    """The keys whose values differ between the runs (missing in one counts), and how many are the same."""
    keys = list(dict.fromkeys(k for f in facts for k in f))
    differ = [k for k in keys if len({f.get(k) for f in facts}) > 1]
    return differ, len(keys) - len(differ)


def compare_figures(runs: list[tuple[str, RunData]]):
    """[(chart name, figure)]: a chart a metric (in the order they first came), a line a run: its
    one rank's values, or, where several ranks printed it, their median at each step with their
    spread (least to most) shaded in the run's colour. A break where an attempt ended."""
    import plotly.graph_objects as go
    from plotly.colors import hex_to_rgb, qualitative

    names: list[str] = list(dict.fromkeys(r.name for _, data in runs for r in data.metrics))[:CHARTS_MOST]
    figures = []
    for i, name in enumerate(names):
        fig, all_by_step = go.Figure(), True
        for k, (job, data) in enumerate(runs):
            rows = [r for r in data.metrics if r.name == name]
            if not rows:
                continue
            ranks = sorted({r.rank for r in rows})
            by_step = all(r.step is not None for r in rows)
            all_by_step &= by_step
            origin, colour = min(r.time for r in rows), qualitative.Plotly[k % len(qualitative.Plotly)]
            if len(ranks) == 1:
                xs, ys = series(rows, by_step, origin)
                label = f"{job} (rank {ranks[0]})"
            else:
                xs, ys, least, most = spread(rows, by_step, origin)
                label = f"{job} (median of {len(ranks)} ranks)"
                fig.add_trace(go.Scatter(x=xs, y=most, mode="lines", line={"width": 0}, showlegend=False,
                                         legendgroup=job, hoverinfo="skip"))
                fig.add_trace(go.Scatter(x=xs, y=least, mode="lines", line={"width": 0}, fill="tonexty", showlegend=False,
                                         fillcolor="rgba({},{},{},0.15)".format(*hex_to_rgb(colour)),
                                         legendgroup=job, hoverinfo="skip"))
            fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name=esc(label), line={"color": colour},
                                     legendgroup=job, connectgaps=False))
        fig.update_layout(title=esc(name), xaxis_title="step" if all_by_step else "step, or seconds since the run's start",
                          yaxis_title=esc(name), height=380, margin={"t": 50, "b": 40}, legend={"font": {"size": 10}})
        figures.append((f"compare-{i}", fig))
    return figures


def make_comparison(wheres: list[str], path: str) -> str:
    """Write the page comparing the runs in ``wheres`` (runs/<job>/ folders) to ``path``; its path."""
    from ..ownfiles import no_link_open
    from .report import chart_div, head

    runs = [(os.path.basename(os.path.abspath(w)), load(w)) for w in wheres]
    facts = [facts_of(w, data) for w, (_, data) in zip(wheres, runs)]
    differ, same = differences(facts)
    columns = "".join(f"<th>{esc(job)}</th>" for job, _ in runs)
    rows = "".join(f"<tr><th>{esc(k)}</th>" + "".join(f"<td>{esc(f.get(k, '(not set)'))}</td>" for f in facts) + "</tr>"
                   for k in differ)
    table = (f"<h2>What differed</h2><table class=ran><tr><th></th>{columns}</tr>{rows}</table>"
             f"<p>{same} other setting(s), the same in every run.</p>")
    missing = [f"{job}: {m}" for job, data in runs for m in data.missing] + \
        [f"{job}: printed no metrics" for job, data in runs if not data.metrics]
    charts = [chart_div(name, fig) for name, fig in compare_figures(runs)]
    parts = [f"<h1>ddp-up: {len(runs)} runs side by side</h1>", *(charts or ["<p>No run printed metrics.</p>"]), table,
             ("<div class=missing><b>Not on this page:</b><ul>" + "".join(f"<li>{esc(m)}</li>" for m in missing)
              + "</ul></div>") if missing else ""]
    page = head(f"ddp-up: {len(runs)} runs") + "\n".join(parts) + "</body></html>\n"
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp")
    with os.fdopen(no_link_open(tmp, fresh=True, mode=0o600), "w", encoding="utf-8") as f:
        f.write(page)
    os.replace(tmp, path)
    return path
