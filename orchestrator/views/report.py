"""The run's report: ``runs/<job>/report.html``, one self-contained page that opens offline in any
browser, drawn by Plotly from what the run left in its folder: the timeline (timeline.py), the
summary (summary.json) and what ran (run.json). Made at the run's end, and again by ddp-report.

Plotly is imported here only, when a report is made: ddp-up's start pays nothing for it. Every
text on the page came from a rank, a node or a file, and is escaped: for the page's own HTML by
``html.escape``; for a chart's labels too, since Plotly reads a few HTML tags in them; and Plotly
writes its data with ``<``, ``>`` and ``/`` as JSON escapes, so no text can close a script. What
the run masked (secrets) is masked in these files already.
"""

from __future__ import annotations

import base64
import functools
import os
import re

from ..ownfiles import no_link_open, own_dir
from .rundata import RunData, esc, load

REPORT = "report.html"


def make_report(where: str) -> str:
    """Write ``where``/report.html from the folder's files; its path."""
    page = render(load(where))
    path = os.path.join(own_dir(where, private=True), REPORT)
    tmp = os.path.join(where, f".{REPORT}.tmp")
    with os.fdopen(no_link_open(tmp, fresh=True, mode=0o600), "w", encoding="utf-8") as f:
        f.write(page)
    os.replace(tmp, path)
    return path


# Plotly's basic bundle (scatter and bar, all the page draws; plotly.js-basic-dist-min from npm, at
# the plotly.js version the plotly package writes figures for), gzipped as it ships in the package:
# 0.4 MB, where the full bundle is 4.8 MB as it is and 2.0 MB packed. vendor/README.md says how to
# bring it up to date.
PLOTLY_BUNDLE = os.path.join(os.path.dirname(__file__), "vendor", "plotly-basic.min.js.gz")


@functools.lru_cache(maxsize=1)
def plotly_packed() -> str:
    """Plotly's script, gzipped and in base64 (0.53 MB), for the page to unpack."""
    with open(PLOTLY_BUNDLE, "rb") as f:  # the package's own file
        return base64.b64encode(f.read()).decode()


# The page unpacks Plotly's script with the browser's own DecompressionStream (Chromium 80+,
# Firefox 113+, Safari 16.4+), then draws each chart, whose script waits as text/x-ddp-up-chart.
UNPACK = """(async function () {
  var packed = document.getElementById('plotly-packed').textContent;
  var bytes = Uint8Array.from(atob(packed), function (c) { return c.charCodeAt(0); });
  var js = await new Response(new Blob([bytes]).stream().pipeThrough(new DecompressionStream('gzip'))).text();
  (0, eval)(js);
  document.querySelectorAll('script[type="text/x-ddp-up-chart"]').forEach(function (s) { (0, eval)(s.textContent); });
  window.ddpUpDrawn = true;  // every chart drawn: a reader of the page (its tests) waits for this
  document.dispatchEvent(new Event('ddp-up-drawn'));
})();"""


CHART_SCRIPT = re.compile(r'<script(?: type="text/javascript")?>')  # Plotly's own (it escapes "<" in its data)


def head(title: str) -> str:
    """A page's head: its title, style and Plotly's packed script with what unpacks it."""
    return (f"<!DOCTYPE html><html lang=en><head><meta charset=utf-8><title>{title}</title><style>{STYLE}</style>"
            f"<script id=plotly-packed type=application/octet-stream>{plotly_packed()}</script>"
            f"<script>{UNPACK}</script></head><body>")


def render(data: RunData) -> str:
    from .charts import figures

    from .metriccharts import metrics_section

    charts = [chart_div(name, fig) for name, fig in figures(data)]
    run = data.kind("run")
    origin = run[0].get("started") if run and isinstance(run[0].get("started"), (int, float)) else \
        min((r.time for r in data.metrics), default=0.0)
    worlds = {a.get("attempt"): a.get("world_size") for a in data.kind("attempt")}
    learned, table = metrics_section(data.metrics, worlds, origin, esc)
    partial = "" if data.kind("end") else " (partial: made while the run went on)"
    parts = [f"<h1>ddp-up run {esc(data.job_id)}{partial}</h1>", outcome(data), missing(data), root_cause(data), table,
             *(chart_div(name, fig) for name, fig in learned), attempts(data),
             "<h2>The machine</h2>" if charts else "", *charts, what_ran(data), gpus_said(data)]
    return head(f"ddp-up {esc(data.job_id)}") + "\n".join(p for p in parts if p) + "</body></html>\n"


def chart_div(name: str, fig) -> str:
    import plotly.io as pio

    drawn = pio.to_html(fig, include_plotlyjs=False, full_html=False, div_id=f"chart-{name}",
                        config={"displaylogo": False})
    # its script runs once Plotly is unpacked (UNPACK); Plotly's own JSON escapes keep any text inside it
    return "<section class=chart>" + CHART_SCRIPT.sub('<script type="text/x-ddp-up-chart">', drawn) + "</section>"


def outcome(data: RunData) -> str:
    summary = data.summary or {}
    end = data.kind("end")
    status = summary.get("exit_code", end[-1].get("exit_status") if end else None)
    words = "ok" if status == 0 else "failed" if status is not None else "unknown"
    if summary.get("interrupted_by"):
        words = f"stopped (signal {summary['interrupted_by']})"
    return (f"<p class=outcome>{esc(words)}: exit status {esc(status)}; started {esc(summary.get('started'))}, "
            f"ended {esc(summary.get('ended'))}; world size {esc(summary.get('world_size'))}; master "
            f"{esc(summary.get('master'))}; script {esc(summary.get('script'))}</p>")


def missing(data: RunData) -> str:
    if not data.missing:
        return ""
    items = "".join(f"<li>{esc(m)}</li>" for m in data.missing)
    return f"<div class=missing><b>Not on this page:</b><ul>{items}</ul></div>"


def root_cause(data: RunData) -> str:
    root = (data.summary or {}).get("root_cause")
    if not isinstance(root, dict):
        return ""
    trace = root.get("traceback") or []
    lines = "\n".join(str(t) for t in trace) if isinstance(trace, list) else str(trace)
    return (f"<h2>Root cause</h2><p>{esc(root.get('host'))} (node {esc(root.get('node'))}, rank "
            f"{esc(root.get('rank'))}): {esc(root.get('what'))}</p>"
            + (f"<p class=exception>{esc(root.get('exception'))}</p>" if root.get("exception") else "")
            + (f"<pre class=traceback>{esc(lines)}</pre>" if lines else ""))


def attempts(data: RunData) -> str:
    rows = data.kind("attempt")
    if not rows:
        return ""
    cells = "".join(
        f"<tr><td>{esc(a.get('attempt'))}</td><td>{esc(len(a.get('nodes') or []))}</td><td>{esc(a.get('world_size'))}</td>"
        f"<td>{esc(a.get('start'))}</td><td>{esc(a.get('end'))}</td><td>{esc(a.get('end_why'))}</td>"
        f"<td>{esc(a.get('cause'))}</td><td>{esc(a.get('next'))}</td></tr>" for a in rows)
    return ("<h2>Attempts</h2><table><tr><th>attempt</th><th>nodes</th><th>world size</th><th>start (s)</th>"
            f"<th>end (s)</th><th>end</th><th>cause</th><th>then</th></tr>{cells}</table>")


def what_ran(data: RunData) -> str:
    run = data.run or {}
    git = run.get("git") or {}
    items = [("command", " ".join(map(str, run.get("command") or []))), ("in", run.get("cwd")),
             ("cluster file", run.get("cluster_file")),
             ("commit", f"{git.get('commit')} ({git.get('branch')}{', with changes' if git.get('dirty') else ''})"
              if git.get("commit") else None),
             ("versions", ", ".join(f"{k} {v}" for k, v in (run.get("versions") or {}).items()))]
    nodes = [n for n in (data.summary or {}).get("nodes") or [] if isinstance(n, dict)]
    items += [(f"node {n.get('node')} {n.get('host')}", ", ".join(f"{k} {n.get(k)}" for k in
                                                                  ("python", "torch", "cuda", "nccl") if n.get(k)))
              for n in nodes]
    rows = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in items if v)
    return f"<h2>What ran</h2><table class=ran>{rows}</table>" if rows else ""


def gpus_said(data: RunData) -> str:
    """What nvidia-smi said of each node's GPUs at the preflight (summary.json's)."""
    rows = "".join(f"<tr><td>{esc(n.get('host'))}</td><td>{esc(g.get('index'))}</td><td>{esc(g.get('name'))}</td>"
                   f"<td>{esc(g.get('said'))}</td></tr>"
                   for n in (data.summary or {}).get("nodes") or [] if isinstance(n, dict)
                   for g in n.get("gpus") or [] if isinstance(g, dict))
    return ("<h2>GPUs at the preflight</h2><table><tr><th>node</th><th>GPU</th><th>name</th>"
            f"<th>nvidia-smi said</th></tr>{rows}</table>") if rows else ""


STYLE = """body{font-family:system-ui,sans-serif;margin:1.5em;max-width:1400px;color:#222}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.5em}.outcome{font-size:1.05em}
.missing{background:#fff4e5;border:1px solid #f0b37e;padding:.5em 1em}
pre.traceback{background:#f6f6f6;padding:.8em;overflow-x:auto;white-space:pre-wrap}
table{border-collapse:collapse}td,th{border:1px solid #ddd;padding:.25em .6em;text-align:left;vertical-align:top}
section.chart{margin-top:1em}"""
