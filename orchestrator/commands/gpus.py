"""The GPU measure (diagnose/gpuspeed.py) as a job of its own: ddp-check --gpus, and the gate
before a launch whose cluster file sets `measure_gpus: true`."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from rich.console import Console
from rich.text import Text

from ..clean import outside, safe_text
from ..diagnose import gpuspeed
from ..errors import EXIT_JOB_FAILED, EXIT_OK, EXIT_SETUP, Interrupted, SetupError
from ..job.loop import Job
from ..plan.launch import new_job_id
from ..remote import signals
from .common import ReportView, interrupted, report, table_console


class GpuView(ReportView):
    """Keeps every rank's measure (one each at most)."""

    def __init__(self, console: Console, prog: str, ranks: int):
        super().__init__(console, prog)
        self.ranks = ranks
        self.measures: list[gpuspeed.Measured] = []

    def take(self, node, line) -> bool:
        measured = gpuspeed.read_report(node.index, line.text)
        if measured is None or len(self.measures) >= self.ranks:
            return False
        self.measures.append(measured)
        return True


@dataclass
class GpuMeasure:
    """What one measure found: the verdicts, slow first, or why there are none."""

    labels: list[str]
    verdicts: list[gpuspeed.Verdict] = field(default_factory=list)
    no_gpu: bool = False  # no node has an NVIDIA GPU: nothing to measure, and nothing wrong
    failure: str | None = None  # the root cause where ranks died before their reports
    missing: int = 0  # GPUs without a report
    last: list[str] = field(default_factory=list)  # the failed node's last lines

    @property
    def slow(self) -> list[gpuspeed.Verdict]:
        return [v for v in self.verdicts if v.slow]

    @property
    def ok(self) -> bool:
        return not self.failure and not self.slow


def measure(config, console: Console, inbox: signals.SignalInbox, prog: str) -> GpuMeasure:
    """Every GPU of ``config``'s nodes measured at once (the preflight of a launch first). SetupError
    where a node is not ready; Interrupted on a stop from the user."""
    plan = gpuspeed.measure_plan(config, new_job_id(), os.getcwd())
    view = GpuView(console, prog, plan.world_size)
    job = Job(plan, view, inbox=inbox)
    console.print(f"{prog}: every GPU of {len(plan.nodes)} node(s) measured at once, one process each",
                  markup=False, highlight=False)
    try:
        result = job.run()
    finally:
        job.close()
    if job.interrupted:
        raise Interrupted(job.interrupted)
    labels = [n.label for n in plan.nodes]
    measured = [m for m in view.measures if not m.no_gpu]
    found = GpuMeasure(labels, missing=plan.world_size - len(view.measures))
    if view.measures and not measured and not found.missing:
        found.no_gpu = True
        return found
    cause = result.root_cause
    if found.missing or not measured:  # a rank that died before its report (CUDA out of memory, say)
        found.failure = plan.mask(cause.render()) if cause else "no report"
        found.last = [plan.mask(t) for t in view.last.get(cause.node if cause else 0, [])]
        found.missing = found.missing or plan.world_size
    found.verdicts = gpuspeed.judge(measured, {s.plan.index: s.info.get("gpu_health") or [] for s in job.status})
    return found


def show(found: GpuMeasure, console: Console, prog: str, as_json: bool = False) -> None:
    if found.no_gpu:
        console.print(f"{prog}: no NVIDIA GPU on any node: nothing to measure", markup=False, highlight=False)
        return
    if as_json:
        for record in gpuspeed.records(found.verdicts, found.labels):
            print(json.dumps(record))
    elif found.verdicts:
        table_console().print(gpuspeed.render(found.verdicts, found.labels))
        warm = gpuspeed.warm_text(found.verdicts)
        if warm:
            console.print(f"{prog}: {warm}", markup=False, highlight=False, style="dim")
    for line in gpuspeed.slow_lines(found.verdicts, found.labels):
        console.print(Text("✗ ", style="bold red") + outside(line))
    if found.failure:
        console.print(Text("✗ ", style="bold red") + outside(f"{found.missing} GPU(s) not measured: {found.failure}"))
        for text in found.last:
            console.print(Text(f"  {safe_text(text)}"))


def check_gpus(config, console: Console, inbox: signals.SignalInbox, as_json: bool) -> int:
    """ddp-check --gpus: exit 0 where every GPU keeps its peers' pace (or there is none), 3 where
    one does not, 1 where the measure itself failed everywhere."""
    try:
        found = measure(config, console, inbox, "ddp-check")
    except SetupError as e:
        return report("ddp-check", e, config.secret_values)
    except Interrupted as e:
        return interrupted("ddp-check", e, "while measuring; every node stopped its part")
    show(found, console, "ddp-check", as_json)
    if found.failure and not found.verdicts:
        return EXIT_JOB_FAILED
    return EXIT_OK if found.ok else EXIT_SETUP


def gate(config, console: Console, inbox: signals.SignalInbox, allowed: bool) -> int | None:
    """Before a launch (`measure_gpus: true`): None to go on, else the exit status. A slow GPU stops
    the launch as an unhealthy one does, unless --allow-unhealthy-gpus."""
    found = measure(config, console, inbox, "ddp-up")
    show(found, console, "ddp-up")
    if found.ok or found.no_gpu:
        return None
    if allowed and not found.failure:
        console.print("ddp-up: starting anyway (--allow-unhealthy-gpus)", markup=False, highlight=False)
        return None
    console.print(outside("ddp-up: the GPU measure before the launch found the above; nothing was started. Drain "
                          "the node or choose other GPUs (CUDA_VISIBLE_DEVICES in `env:`), or pass "
                          "--allow-unhealthy-gpus to start anyway", style="bold red"))
    return EXIT_SETUP
