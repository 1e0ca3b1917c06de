"""ddp-check --collective: a short real all_reduce across the nodes, and every node's link.

The measuring runs on the nodes (collective_probe.py, under torchrun, one process per node);
here is the plan that ships it and the reading of its one-line report. Pure: tables are values.

A node's link figure is min(its best outgoing link, its best incoming link), each measured
against two partners. A node far below the median of those figures (SLOW_RATIO) is named slow:
its partners each have another, healthy link, so they are not. With two nodes there is one link
and nothing to compare it with: the table shows it, and no node is named.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from rich.console import Group
from rich.table import Table
from rich.text import Text

from ..clean import outside
from ..config.cluster import ClusterConfig
from ..node.protocol.stragglers import Lateness, LateWatch
from ..plan.launch import LaunchPlan, make_plan
from ..remote.sync import human_bytes
from .logparse import tagged_json

MODULE = "ddp_up_collective"
REPORT = "DDP_UP_COLLECTIVE "
SLOW_RATIO = 3.0  # a node whose link figure is a third of the median, or less, is slow


def probe_plan(config: ClusterConfig, job_id: str, cwd: str) -> LaunchPlan:
    """One process per node (a link is a node's, not a GPU's), under torchrun whatever the
    cluster file's launcher, running the probe shipped in the spec. Warm unless the cluster file
    says `warm: false`: torchrun and the probe forked from one interpreter that imported torch (a
    node imports it once, not twice), and only torch: the job's own `preload:` is not the probe's."""
    one_each = replace(config, nodes=tuple(replace(n, gpus=1) for n in config.nodes), launcher="torchrun",
                       preload=())
    source = (Path(__file__).parent / "collective_probe.py").read_text()
    return replace(make_plan(one_each, "", [], job_id, cwd), module=MODULE, hooks={f"{MODULE}.py": source})


def read_report(text: str) -> dict | None:
    """The probe's report from one line rank 0 printed, or None if the line is not it."""
    report = tagged_json(text, REPORT)
    return report if report is not None and "links" in report else None


@dataclass(frozen=True)
class NodeLink:
    node: int
    out_bw: float  # bytes/s: the best of its outgoing links
    in_bw: float  # bytes/s: the best of its incoming links
    latency: float  # seconds: the median small exchange it received
    slow: bool

    @property
    def figure(self) -> float:
        return min(self.out_bw, self.in_bw)


def node_links(report: dict) -> list[NodeLink]:
    world = report["world"]
    out: dict[int, list[float]] = {r: [] for r in range(world)}
    into: dict[int, list[float]] = {r: [] for r in range(world)}
    latency: dict[int, list[float]] = {r: [] for r in range(world)}
    for src, dst, size, seconds, ping in report["links"]:
        bw = size / max(seconds, 1e-9)
        out[src].append(bw)
        into[dst].append(bw)
        latency[dst].append(ping)
    figures = {r: min(max(out[r], default=0.0), max(into[r], default=0.0)) for r in range(world)}
    median = statistics.median(figures.values()) if figures else 0.0
    return [NodeLink(r, max(out[r], default=0.0), max(into[r], default=0.0),
                     statistics.median(latency[r]) if latency[r] else 0.0,
                     slow=world >= 3 and figures[r] * SLOW_RATIO <= median)
            for r in range(world)]


def lateness(report: dict) -> list[Lateness]:
    """Each node's lateness at the probe's small all_reduces, judged as a running job's is."""
    paces = report.get("arrivals")
    world = report["world"]
    if not isinstance(paces, list) or len(paces) != world or world < 2:
        return []
    watch = LateWatch(world)
    for i in range(min(len(p) for p in paces)):
        watch.compare({node: (paces[node][i], node) for node in range(world)})
    return watch.figures()


def start_text(report: dict) -> str:
    """What the check's time outside the measuring went to, after connect and preflight: the start
    and each node's import of torch, and on how many nodes the probe was forked from a warm
    interpreter (the count the ranks reported: shown only where it is one)."""
    warm, world = report.get("warm"), report.get("world")
    if type(warm) is not int or type(world) is not int or not 0 < warm <= world:
        return "start, import torch"
    return f"start, import torch; the probe forked from a warm interpreter on {warm} of {world} nodes"


def pace_text(late: Lateness | None) -> Text:
    if late is None:
        return Text("")
    return Text(f"straggler: {late.text()}", style="bold red") if late.straggler else Text(late.text(), style="dim")


def slow_nodes(links: list[NodeLink]) -> list[int]:
    return [link.node for link in links if link.slow]


def rate(bw: float) -> str:
    return f"{human_bytes(int(bw))}/s"


def render(report: dict, labels: list[str]) -> Group:
    """The all_reduce table, then one row per node with its link figures."""
    world = report["world"]
    reduce = Table(title=outside(f"all_reduce across {world} nodes ({report['backend']})"), title_justify="left")
    for column in ("size", "time", "algbw", "busbw"):
        reduce.add_column(column, justify="right", no_wrap=True)
    for size, seconds in report["all_reduce"]:
        if seconds is None:
            reduce.add_row(human_bytes(size), Text("skipped: the smaller size says too slow", style="yellow"), "", "")
            continue
        algbw = size / max(seconds, 1e-9)
        # busbw: what each link carried (NCCL's tests' measure); one rank sends nothing
        busbw = rate(algbw * 2 * (world - 1) / world) if world > 1 else "-"
        reduce.add_row(human_bytes(size), f"{seconds * 1e3:.2f} ms", rate(algbw), busbw)
    if not report["links"]:  # one node: a ring of one has no link to measure (and showed 0 bytes/s)
        return Group(reduce, Text("one node: no link to another node to measure", style="dim"))
    links = node_links(report)
    median = statistics.median(link.figure for link in links) if links else 0.0
    table = Table(title="each node's link (a ring: to and from two partners)", title_justify="left")
    paces = {late.node: late for late in lateness(report)}
    for column in ("node", "host", "out", "in", "latency", "collectives", ""):
        table.add_column(column, justify="left" if column in ("host", "collectives", "") else "right", no_wrap=True)
    for link in links:
        verdict = Text(f"slow: {link.figure / median:.2f}× the median", style="bold red") if link.slow else Text("")
        table.add_row(str(link.node), outside(labels[link.node] if link.node < len(labels) else "?"), rate(link.out_bw),
                      rate(link.in_bw), f"{link.latency * 1e3:.2f} ms", pace_text(paces.get(link.node)), verdict)
    return Group(reduce, table)
