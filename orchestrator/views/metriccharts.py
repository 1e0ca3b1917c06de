"""The report's first section: what the run learned (metrics.csv, views/metricsfile.py). A chart a
metric on its step axis, a line a rank (past a handful of ranks: rank 0, the median and the
spread), a break where an attempt ended, each attempt's start marked with its world size (a
shrink and a grow show where they happened), a smoothing control as TensorBoard's; and a table of
each metric's last and best values, with their steps. Imported only when a report is made.
"""

from __future__ import annotations

import csv
import io
import math
import os
from dataclasses import dataclass
from statistics import median

from ..config.metricpatterns import plain_name
from ..node.local.state import read_regular
from .metricsfile import COLUMNS, NAME, ROWS_MOST

READ_MOST = 256 << 20  # bytes of metrics.csv read (ROWS_MOST rows stay well within)
CHARTS_MOST = 24  # metrics charted (the table names every one)
RANKS_DRAWN = 8  # past this many ranks: rank 0, the median and the spread
SMOOTHING = (0.0, 0.6, 0.9)  # the control's weights (an exponential moving average, as TensorBoard's)
LOWER_IS_BETTER = ("loss", "err", "perplexity", "ppl", "wer", "cer", "mse", "mae", "nll")


@dataclass(frozen=True)
class Row:
    time: float
    attempt: int
    rank: int
    node: str
    step: float | None
    name: str
    value: float


def read_rows(where: str, missing: list) -> list[Row]:
    """metrics.csv's rows, each field checked (a damaged row is counted and left out), bounded."""
    raw, why = read_regular(os.path.join(where, NAME), READ_MOST)
    if raw is None:
        return []
    rows, damaged = [], 0
    reader = csv.reader(io.StringIO(raw.decode("utf-8", "replace"), newline=""))
    if next(reader, None) != list(COLUMNS):
        missing.append(f"{NAME}: not ddp-up's metrics file (its header differs)")
        return []
    names: dict[str, bool] = {}  # each name checked once: a run has few, over millions of rows
    for fields in reader:
        row = checked(fields, names) if len(rows) < ROWS_MOST else None
        if row is None:
            damaged += 1
        else:
            rows.append(row)
    if damaged:
        missing.append(f"{damaged} damaged (or past {ROWS_MOST:,}) row(s) of {NAME}, left out")
    return rows


def checked(fields: list[str], names: dict[str, bool]) -> Row | None:
    if len(fields) != len(COLUMNS):
        return None
    at, attempt, rank, node, step, name, value = fields
    try:
        t, a, r, s, v = float(at), int(attempt), int(rank), float(step) if step else 0.0, float(value)
    except ValueError:
        return None
    plain = names.get(name)
    if plain is None:
        plain = names[name] = bool(name) and plain_name(name) == name
    if not (plain and math.isfinite(t + s + v) and 0 <= a < 10**6 and 0 <= r < 10**7 and len(node) <= 255):
        return None
    return Row(t, a, r, node, s if step else None, name, v)


def lower_is_better(name: str) -> bool:
    return any(word in name.lower() for word in LOWER_IS_BETTER)


def smoothed(values: list, weight: float) -> list:
    """TensorBoard's smoothing: an exponential moving average, debiased; None (a break) starts over."""
    out, last, count = [], 0.0, 0
    for v in values:
        if v is None:
            out.append(None)
            last, count = 0.0, 0
            continue
        count += 1
        last = last * weight + (1 - weight) * v
        out.append(last / (1 - weight ** count) if weight else v)
    return out


def series(rows: list[Row], by_step: bool, origin: float) -> tuple[list, list]:
    """(x, y) of one rank's values in order, None between two attempts (the line breaks there)."""
    xs, ys, attempt = [], [], None
    for row in sorted(rows, key=lambda r: (r.attempt, r.time)):
        if attempt is not None and row.attempt != attempt:
            xs.append(None)
            ys.append(None)
        attempt = row.attempt
        xs.append(row.step if by_step else round(row.time - origin, 3))
        ys.append(row.value)
    return xs, ys


def spread(rows: list[Row], by_step: bool, origin: float) -> tuple[list, list, list, list]:
    """(x, median, least, most) over the ranks at each step (or second) of each attempt."""
    at: dict[tuple, list] = {}
    for row in rows:
        at.setdefault((row.attempt, row.step if by_step else round(row.time - origin)), []).append(row.value)
    xs, mid, low, high, attempt = [], [], [], [], None
    for (each, x), values in sorted(at.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        if attempt is not None and each != attempt:
            for part in (xs, mid, low, high):
                part.append(None)
        attempt = each
        xs.append(x)
        mid.append(median(values))
        low.append(min(values))
        high.append(max(values))
    return xs, mid, low, high


def metric_figure(name: str, rows: list[Row], worlds: dict, origin: float, esc):
    """One metric's chart: a line a rank (or rank 0, the median and the spread), attempts marked,
    with the smoothing control."""
    import plotly.graph_objects as go

    by_step = all(r.step is not None for r in rows)
    ranks = sorted({r.rank for r in rows})
    fig, raw = go.Figure(), []
    if len(ranks) <= RANKS_DRAWN:
        for rank in ranks:
            xs, ys = series([r for r in rows if r.rank == rank], by_step, origin)
            raw.append((f"rank {rank}", xs, ys))
    else:
        xs, ys = series([r for r in rows if r.rank == ranks[0]], by_step, origin)
        raw.append((f"rank {ranks[0]}", xs, ys))
        sx, mid, low, high = spread(rows, by_step, origin)
        fig.add_trace(go.Scatter(x=sx, y=high, mode="lines", line={"width": 0}, showlegend=False, hoverinfo="skip"))
        fig.add_trace(go.Scatter(x=sx, y=low, mode="lines", line={"width": 0}, fill="tonexty",
                                 fillcolor="rgba(100,100,200,0.2)", name=f"spread of {len(ranks)} ranks"))
        raw.append(("median", sx, mid))
    fixed = len(fig.data)
    for label, xs, ys in raw:
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines+markers" if len(xs) < 50 else "lines", name=esc(label),
                                 connectgaps=False, marker={"size": 4}))
    for weight in SMOOTHING[1:]:
        for label, xs, ys in raw:
            fig.add_trace(go.Scatter(x=xs, y=smoothed(ys, weight), mode="lines", connectgaps=False, visible=False,
                                     name=esc(f"{label} (smoothed {weight:g})")))
    buttons = smoothing_buttons(fixed, len(raw))
    starts: dict[int, float] = {}
    for row in rows:
        x = row.step if by_step else row.time - origin
        starts[row.attempt] = min(starts.get(row.attempt, x), x)
    for attempt, x in sorted(starts.items()):
        if attempt:
            world = worlds.get(attempt)
            fig.add_vline(x=x, line_dash="dot", line_color="#888",
                          annotation_text=esc(f"attempt {attempt}" + (f": world {world}" if world else "")),
                          annotation_position="top left")
    fig.update_layout(title=esc(name) + ("" if len(ranks) > 1 else f" (rank {ranks[0]})"),
                      xaxis_title="step" if by_step else "seconds since the run's start", yaxis_title=esc(name),
                      height=380, margin={"t": 60, "b": 40}, legend={"font": {"size": 10}},
                      updatemenus=[{"type": "buttons", "direction": "left", "x": 1.0, "xanchor": "right", "y": 1.18,
                                    "buttons": buttons, "showactive": True}])
    if len({(r.attempt, r.step if by_step else r.time) for r in rows}) == 1:
        fig.add_annotation(text="one point only", showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5)
    return fig


def smoothing_buttons(fixed: int, count: int) -> list[dict]:
    """The control: each weight shows its smoothed lines, and the raw ones faint behind them (the
    ``fixed`` traces first, then ``count`` raw ones, then ``count`` smoothed ones a weight)."""
    buttons = []
    for i, weight in enumerate(SMOOTHING):
        visible = [True] * fixed + [True] * count + [j // count == i - 1 for j in range(count * (len(SMOOTHING) - 1))]
        opacity = [1.0] * fixed + [1.0 if i == 0 else 0.25] * count + [1.0] * (count * (len(SMOOTHING) - 1))
        buttons.append({"label": f"smoothing {weight:g}", "method": "restyle",
                        "args": [{"visible": visible, "opacity": opacity}]})
    return buttons


def metrics_section(rows: list[Row], worlds: dict, origin: float, esc) -> tuple[list, str]:
    """([(chart name, figure)], the table's HTML) for every metric, in the order each first came."""
    names: dict[str, list[Row]] = {}
    for row in rows:
        names.setdefault(row.name, []).append(row)
    if not names:
        return [], ""
    figures = [(f"metric-{i}", metric_figure(name, kept, worlds, origin, esc))
               for i, (name, kept) in enumerate(list(names.items())[:CHARTS_MOST])]
    lines = []
    for name, kept in names.items():
        first_rank = min(r.rank for r in kept)  # rank 0's, as a single-process run would print it
        last = max((r for r in kept if r.rank == first_rank),
                   key=lambda r: (r.attempt, r.step if r.step is not None else r.time, r.time))
        pick = min if lower_is_better(name) else max
        best = pick(kept, key=lambda r: r.value)
        where = lambda r: f"step {r.step:g}" if r.step is not None else f"attempt {r.attempt}"  # noqa: E731
        lines.append(f"<tr><td>{esc(name)}</td><td>{last.value:.6g}</td><td>{esc(where(last))}</td>"
                     f"<td>{best.value:.6g}</td><td>{esc(where(best))} (rank {best.rank})</td></tr>")
    more = f"<p>{len(names) - CHARTS_MOST} more metric(s) in the table only</p>" if len(names) > CHARTS_MOST else ""
    table = ("<h2>What the run learned</h2><table class=metrics><tr><th>metric</th><th>last</th><th>at</th>"
             "<th>best</th><th>at</th></tr>" + "".join(lines) + "</table>" + more)
    return figures, table
