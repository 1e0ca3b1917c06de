"""The report of a long run: its data's size and the time to make its page, for the 24-hour example
(64 nodes of 8 GPUs: 512 ranks, each with a progress bar and lines, 512 GPUs sampled, 64 nodes'
late times), with and without its metrics (benchmarks.metrics's metrics.csv of those 512
ranks), and what the report costs ddp-up's start.

    python3 -m benchmarks.report [--hours 24] [--nodes 64] [--every 30]

The timeline (views/timeline.py) is fed a sample of every series every --every seconds of a
fake clock, as a run of that length would feed it, then written; the page is made from it
(views/report.py, Plotly). The start: `ddp-up --version` and the import of every command module,
with Plotly left out of them (it is imported only when a report is made), against `python3 -c pass`
in the same run, the baseline.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

from orchestrator.config.clusterfile import parse_cluster
from orchestrator.diagnose.progress import Bar
from orchestrator.job.events import LogLine
from orchestrator.node.protocol.stragglers import Lateness
from orchestrator.plan.launch import make_plan
from orchestrator.views.report import make_report
from orchestrator.views.timeline import NAME, Timeline

from .metrics import metrics_csv

START = "import orchestrator.commands.up, orchestrator.commands.attach, orchestrator.commands.report, sys; " \
        "assert 'plotly' not in sys.modules"


def feed(where: str, hours: float, nodes: int, every: float) -> float:
    """A run of ``hours`` on ``nodes`` nodes of 8 GPUs, fed to the timeline: seconds it took."""
    text = "nodes: [" + ", ".join(f"{{host: gpu-{i:03d}, gpus: 8}}" for i in range(nodes)) + "]\n"
    plan = make_plan(parse_cluster(text), "train.py", [], "J24H", "/tmp")
    clock = SimpleNamespace(now=1_800_000_000.0)
    kept = Timeline(where, plan, wall=lambda: clock.now)
    began, steps = time.perf_counter(), int(hours * 3600 / every)
    for step in range(steps):
        clock.now += every
        for node in plan.nodes:
            n = step * 10 + node.index
            kept.bars(node, [Bar("err", r, (f"train: {n % 100}%|#####| {n}/{steps * 10} [01:00<02:00, {9 + node.index % 3:.2f}it/s]",))
                             for r in node.ranks])
            kept.lines(node, [LogLine("out", r, "step") for r in node.ranks])
            kept.gpus(node, [[g, 80 + g, 60000 + g, 81559] for g in range(8)])
        kept.late([Lateness(i, 100, 10, 0.01 * (i % 7), i * 8) for i in range(nodes)])
    kept.finished(SimpleNamespace(exit_code=0), attempts=())
    return time.perf_counter() - began


def start_cost(code: str, repeat: int = 5) -> tuple[float, int]:
    """(median seconds, max RSS KiB) of ``python3 -c code``, its RSS as it says itself at its end
    (VmHWM: getrusage's counts the forked parent's pages, kept across exec)."""
    took, rss = [], 0
    said = ("\nimport sys as _s; _s.stderr.write('RSS %s\\n' % next(l.split()[1] for l in open('/proc/self/status') "
            "if l.startswith('VmHWM')))")
    for _ in range(repeat):
        began = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", code + said], check=False, capture_output=True, text=True)
        took.append(time.perf_counter() - began)
        rss = max([rss] + [int(line.split()[1]) for line in done.stderr.splitlines() if line.startswith("RSS ")])
    return sorted(took)[len(took) // 2], rss


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hours", type=float, default=24)
    p.add_argument("--nodes", type=int, default=64)
    p.add_argument("--every", type=float, default=30, help="seconds between two samples of a series")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as where:
        fed = feed(where, args.hours, args.nodes, args.every)
        began = time.perf_counter()
        page = make_report(where)
        made = time.perf_counter() - began
        data, html = os.path.getsize(os.path.join(where, NAME)), os.path.getsize(page)
        rows = metrics_csv(where, args.nodes * 8, args.hours, 1_800_000_000.0)
        began = time.perf_counter()
        page = make_report(where)
        made_metrics = time.perf_counter() - began
        html_metrics = os.path.getsize(page)
    print(f"{args.hours:g} h, {args.nodes} nodes x 8 GPUs, a sample every {args.every:g} s")
    print(f"| what | value |\n|---|---|\n| {NAME} | {data / 1e6:.2f} MB |\n| report.html | {html / 1e6:.2f} MB |")
    print(f"| timeline fed ({args.nodes * 8 * 3 + args.nodes} series) | {fed:.1f} s |\n| page made | {made:.2f} s |")
    print(f"| report.html with metrics.csv ({rows:,} rows: a loss, a learning rate) | {html_metrics / 1e6:.2f} MB |")
    print(f"| page made with metrics | {made_metrics:.2f} s |")
    base, base_rss = start_cost("pass")
    ours, ours_rss = start_cost(START)
    plotly, plotly_rss = start_cost("import plotly.graph_objects, plotly.io, plotly.offline; "
                                    "plotly.graph_objects.Figure(plotly.graph_objects.Scatter(x=[1], y=[1]))")
    print(f"\n| start | seconds | max RSS |\n|---|---|---|\n| python3 -c pass (baseline) | {base:.3f} | {base_rss / 1024:.0f} MB |")
    print(f"| ddp-up's command modules (no plotly among them) | {ours:.3f} | {ours_rss / 1024:.0f} MB |")
    print(f"| plotly's import alone, for comparison (a report's) | {plotly:.3f} | {plotly_rss / 1024:.0f} MB |")


if __name__ == "__main__":
    main()
