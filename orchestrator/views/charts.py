"""The report's charts (report.py), as Plotly figures, from a run's timeline: its attempts and
nodes' states on one time axis, each rank's training rate and lines per second, each GPU's
utilization and memory, each node's late time at the collectives. A chart with nothing to show is
left out, and the page says which data the run had none of. Imported only when a report is made.
"""

from __future__ import annotations

from statistics import median

import plotly.graph_objects as go

from .rundata import STATE_COLORS, RunData, esc

AXIS = "seconds since the run's start"


def figures(data: RunData) -> list[tuple[str, go.Figure]]:
    made = [("timeline", timeline(data)), ("rate", rates(data)), ("lines", lines(data)),
            ("gpu-util", gpus(data, 1, "GPU utilization (%)")), ("gpu-memory", gpus(data, 2, "GPU memory used (MiB)")),
            ("late", late(data))]
    for name, what in (("rate", "progress bars"), ("gpu-util", "GPUs reported")):
        if dict(made)[name] is None and data.records:
            data.missing.append(f"{what}: the run had none")
    return [(name, fig) for name, fig in made if fig is not None]


def layout(fig: go.Figure, title: str, y: str, data: RunData | None = None, nodes: set | None = None) -> go.Figure:
    """A time chart's frame: with ``data``, every attempt shaded (odd ones) and named, so that an
    outage and a restart show; a chart whose series all ran on one node names it."""
    if nodes is not None and len(nodes) == 1:
        title += f" on {esc(next(iter(nodes)))}"
    for a in (data.kind("attempt") if data is not None else ()):
        if a.get("attempt") and a.get("start") is not None:
            fig.add_vrect(x0=a["start"], x1=a.get("end") or a["start"], fillcolor="#888", opacity=0.08 * (a["attempt"] % 2),
                          line_width=0, annotation_text=esc(f"attempt {a['attempt']}"), annotation_position="top left")
    fig.update_layout(title=title, xaxis_title=AXIS, yaxis_title=y, height=420, margin={"t": 50, "b": 40},
                      legend={"font": {"size": 10}})
    return fig


def gapped(points: list, step, starts: list, at: int) -> tuple[list, list]:
    """(x, y) of a series' points, broken (None) where it had no data for over two of its buckets
    (a rank that stood on a lost node), and at each attempt's start (``starts``): no line is
    drawn straight across an outage or a restart."""
    xs, ys, last = [], [], None
    gap = 2.5 * (step if isinstance(step, (int, float)) and step > 0 else 2.0)
    for p in points:
        if last is not None and (p[0] - last > gap or any(last < s <= p[0] for s in starts)):
            xs.append(None)
            ys.append(None)
        xs.append(p[0])
        ys.append(p[at])
        last = p[0]
    return xs, ys


def starts_of(data: RunData) -> list:
    return [a["start"] for a in data.kind("attempt") if a.get("attempt") and isinstance(a.get("start"), (int, float))]


def timeline(data: RunData) -> go.Figure | None:
    """Each node's states as bars on one time axis (a bar a stretch in one state, hover: why),
    every attempt's start a line, its end a marker with how it ended and why."""
    states, end = data.kind("state"), data.kind("end")
    last = end[-1].get("t") if end else max([s.get("t", 0) for s in states] +
                                            [a.get("end") or 0 for a in data.kind("attempt")], default=0)
    stretches: dict[str, list] = {}
    by_node: dict[str, list] = {}
    for s in states:
        by_node.setdefault(str(s.get("node")), []).append(s)
    for node, seen in by_node.items():
        for here, after in zip(seen, seen[1:] + [None]):
            until = after.get("t") if after else last
            stretches.setdefault(str(here.get("state")), []).append(
                (node, here.get("t", 0), max(0.0, (until or 0) - (here.get("t") or 0)), here.get("reason")))
    if not stretches:
        return None
    fig = go.Figure()
    for state, parts in stretches.items():
        fig.add_trace(go.Bar(orientation="h", name=esc(state), y=[esc(p[0]) for p in parts],
                             base=[p[1] for p in parts], x=[p[2] for p in parts],
                             marker_color=STATE_COLORS.get(state, "#444"),
                             hovertext=[esc(f"{p[0]}: {state}" + (f" ({p[3]})" if p[3] else "")) for p in parts],
                             hoverinfo="text"))
    ends = [a for a in data.kind("attempt") if a.get("end") is not None]
    if ends:
        fig.add_trace(go.Scatter(x=[a["end"] for a in ends], y=[esc(next(iter(by_node)))] * len(ends),
                                 mode="markers", marker={"symbol": "x", "size": 12, "color": "#000"},
                                 name="attempt ends", hoverinfo="text",
                                 hovertext=[esc(f"attempt {a.get('attempt')}: {a.get('end_why')}; {a.get('cause') or ''}"
                                                  f"{'; then ' + a['next'] if a.get('next') else ''}") for a in ends]))
    for a in data.kind("attempt"):
        fig.add_vline(x=a.get("start") or 0, line_dash="dot", annotation_text=esc(f"attempt {a.get('attempt')}"))
    fig.update_layout(barmode="overlay")
    return layout(fig, "Attempts and each node's states", "node")


def series(data: RunData, kind: str) -> list[dict]:
    return [s for s in data.kind(kind) if isinstance(s.get("points"), list)]


def rates(data: RunData) -> go.Figure | None:
    """Each rank's rate as its progress bar says it; the slowest (lowest median) named."""
    found = [(s, [p for p in s["points"] if len(p) == 3 and p[2] is not None]) for s in series(data, "progress")]
    found = [(s, pts) for s, pts in training_bars(found) if pts]
    if not found:
        return None
    fig, starts = go.Figure(), starts_of(data)
    for s, pts in found:
        xs, ys = gapped(pts, s.get("step"), starts, 2)
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name=esc(f"rank {s.get('rank')} ({s.get('node')})"),
                                 hovertext=esc(s.get("desc")), hoverinfo="x+y+name+text", connectgaps=False))
    slowest = min(found, key=lambda f: median(p[2] for p in f[1]))
    rate = median(p[2] for p in slowest[1])
    said = f"one point only: {rate:.3g}/s" if sum(len(pts) for _, pts in found) == 1 else f"median {rate:.3g}/s"
    title = (f"Training rate per rank ({esc(slowest[0].get('unit') or 'it')}/s): slowest rank "
             f"{esc(slowest[0].get('rank'))} on {esc(slowest[0].get('node'))}, {said}")
    return layout(fig, title, "items a second", data, {s.get("node") for s, _ in found})


def training_bars(found: list) -> list:
    """Of each rank's bars (a series a bar: its description without the numbers), the training
    one: the bar drawn longest (the HF Trainer's checkpoint writer draws a short, fast one)."""
    best: dict = {}
    for s, pts in found:
        key = (s.get("rank"), s.get("node"))
        span = (pts[-1][0] - pts[0][0], len(pts)) if pts else (0, 0)
        if key not in best or span > best[key][0]:
            best[key] = (span, s, pts)
    return [(s, pts) for _, s, pts in best.values()]


def lines(data: RunData) -> go.Figure | None:
    found = series(data, "lines")
    if not found:
        return None
    fig, starts = go.Figure(), starts_of(data)
    for s in sorted(found, key=lambda s: (s.get("rank") is None, s.get("rank") or 0)):
        xs, ys = gapped(s["points"], s.get("step"), starts, 1)
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name=esc(f"rank {s.get('rank')} ({s.get('node')})"),
                                 connectgaps=False))
    return layout(fig, "Lines a second per rank", "lines a second", data, {s.get("node") for s in found})


def gpus(data: RunData, at: int, title: str) -> go.Figure | None:
    found = series(data, "gpu")
    if not found:
        return None
    fig, starts = go.Figure(), starts_of(data)
    for s in found:
        xs, ys = gapped(s["points"], s.get("step"), starts, at)
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name=esc(f"{s.get('node')} GPU {s.get('gpu')}"),
                                 connectgaps=False))
    return layout(fig, title, title.rpartition(" (")[2].rstrip(")"), data, {s.get("node") for s in found})


def late(data: RunData) -> go.Figure | None:
    found = [s for s in series(data, "late") if any(p[1] for p in s["points"])]
    if not found:
        return None
    fig, starts = go.Figure(), starts_of(data)
    for s in found:
        xs, ys = gapped(s["points"], s.get("step"), starts, 1)
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name=esc(s.get("node")), connectgaps=False))
    return layout(fig, "Late at the collectives, per node (median, ms)", "ms after the others", data)
