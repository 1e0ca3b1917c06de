"""ddp-check --gpus: every GPU of every node measured at once, and the one that would slow the
others named. Pure but for the plan: reports in, verdicts and tables out.

The measuring runs on the nodes (gpu_probe.py, one process per GPU, under ddp-up's own launcher:
no rendezvous, nothing between the ranks, each forked from the node's warm interpreter unless the
cluster file says `warm: false`); each rank prints one line, read here by read_report.
A GPU is judged against the median of the GPUs of the same model in the same run (SLOW_RATIO),
which needs no table and catches a throttled GPU among healthy ones, and against its model's
data-sheet peak where PEAKS knows it (PEAK_FLOOR), which catches a node whose GPUs are all slow.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path

from rich.table import Table
from rich.text import Text

from ..clean import outside
from ..config.cluster import ClusterConfig
from ..plan.launch import LaunchPlan, make_plan
from .gpuhealth import describe
from .logparse import tagged_json

MODULE = "ddp_up_gpu_measure"
REPORT = "DDP_UP_GPU "
SLOW_RATIO = 0.85  # below this share of the median of its model, a GPU is slow
PEAK_FLOOR = 0.5  # below this share of its data-sheet peak, a GPU is slow whatever its peers do
METRICS = (("tflops", "matmul TFLOPs"), ("copy_gbs", "copy GB/s"), ("h2d_gbs", "host→GPU GB/s"))
MAX_TEXT = 200  # characters kept of a report's text fields: it is a rank's output, untrusted

# data-sheet peaks (dense): model (as its name contains it; the first match wins) -> bf16 TFLOPs,
# fp32 TFLOPs (no TF32), memory GB/s. A copy's figure counts bytes read and written, as these do.
PEAKS = (
    ("H200 NVL", 835.0, 60.0, 4800.0), ("H200", 989.0, 67.0, 4800.0),
    ("H100 NVL", 835.0, 60.0, 3900.0), ("H100 PCIe", 756.0, 51.0, 2000.0), ("H100", 989.0, 67.0, 3350.0),
    ("A100-SXM4-80GB", 312.0, 19.5, 2039.0), ("A100 80GB PCIe", 312.0, 19.5, 1935.0),
    ("A100", 312.0, 19.5, 1555.0), ("L40S", 362.0, 91.6, 864.0), ("L40", 181.0, 90.5, 864.0),
    ("L4", 121.0, 30.3, 300.0), ("A10", 125.0, 31.2, 600.0),
    ("V100-SXM2", None, 15.7, 900.0), ("V100", None, 14.0, 900.0), ("T4", None, 8.1, 320.0),
)
PCIE_LANE_GBS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}  # one way, per lane, after encoding


def measure_plan(config: ClusterConfig, job_id: str, cwd: str) -> LaunchPlan:
    """One process per GPU of the job (each node's `gpus:`), under ddp-up's own launcher whatever
    the cluster file's, running the probe shipped in the spec. Unhealthy GPUs are measured too:
    that is what the measure is for. Warm unless the cluster file says `warm: false` (the probe
    needs torch on every node, whatever the launcher), with torch alone: the job's own `preload:`
    is not the probe's, and the probes are forked before anything touched CUDA, as a job's ranks."""
    plain = replace(config, launcher="none", warm=config.warm is not False, preload=())
    source = (Path(__file__).parent / "gpu_probe.py").read_text()
    plan = make_plan(plain, "", [], job_id, cwd, allow_unhealthy_gpus=True)
    # a node without an NVIDIA GPU: its probe says so before importing torch, so none is imported for it
    return replace(plan, module=MODULE, hooks={f"{MODULE}.py": source}, warm_gpus_only=True)


def _text(value) -> str | None:
    return value[:MAX_TEXT] if isinstance(value, str) else None


def _rate(value) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
    return float(value) if ok else None


@dataclass(frozen=True)
class Measured:
    """One GPU's measure, as its rank reported it (or why it could not)."""

    node: int
    local_rank: int
    name: str = "?"
    uuid: str | None = None
    dtype: str = "bfloat16"
    rates: dict = field(default_factory=dict)  # METRICS key -> rate, those measured
    error: str | None = None
    no_gpu: bool = False
    seconds: float | None = None  # the rank's own time, from its start (torch's import) to its report
    warm: bool = False  # forked from the node's warm interpreter: torch was imported before it began


def read_report(node: int, text: str) -> Measured | None:
    """A rank's report from one line it printed, or None if the line is not one. Every field is
    checked: the line is the rank's output."""
    report = tagged_json(text, REPORT)
    local = report.get("local_rank") if report is not None else None
    if not isinstance(local, int) or isinstance(local, bool):
        return None
    rates = {key: _rate(report.get(key)) for key, _ in METRICS}
    return Measured(node=node, local_rank=local, name=_text(report.get("name")) or "?", uuid=_text(report.get("uuid")),
                    dtype="float32" if report.get("dtype") == "float32" else "bfloat16",
                    rates={k: v for k, v in rates.items() if v is not None}, error=_text(report.get("error")),
                    no_gpu=report.get("no_gpu") is True, seconds=_rate(report.get("seconds")),
                    warm=report.get("warm") is True)


def peaks_of(name: str, dtype: str, health: dict) -> dict:
    """The data-sheet peak of each METRICS key for this model, where known: the host link's from
    its PCIe generation and width at their maximum (what the slot should give)."""
    found: dict = {}
    for model, bf16, fp32, memory in PEAKS:
        if model in name:
            found = {"tflops": bf16 if dtype == "bfloat16" else fp32, "copy_gbs": memory}
            break
    gen, width = health.get("pcie_gen_max"), health.get("pcie_width_max")
    if isinstance(gen, int) and isinstance(width, int) and gen in PCIE_LANE_GBS:
        found["h2d_gbs"] = PCIE_LANE_GBS[gen] * width
    return {k: v for k, v in found.items() if v}


@dataclass(frozen=True)
class Verdict:
    measured: Measured
    health: dict  # the preflight's facts for this GPU (node/probes/gpuhealth.py), {} where unknown
    vs_median: dict
    vs_peak: dict
    why: tuple  # what makes it slow, in words; () for a GPU at its peers' pace

    @property
    def gpu(self):
        return self.health.get("index")

    @property
    def slow(self) -> bool:
        return bool(self.why) or self.measured.error is not None


def health_of(measured: Measured, node_health: list) -> dict:
    """The preflight facts of the GPU a rank measured: by UUID, else by its place among the job's GPUs."""
    gpus = [g for g in node_health if isinstance(g, dict)]
    for gpu in gpus:
        if measured.uuid and gpu.get("uuid") == measured.uuid:
            return gpu
    return gpus[measured.local_rank] if not measured.uuid and measured.local_rank < len(gpus) else {}


def judge(measures: list[Measured], health: dict[int, list]) -> list[Verdict]:
    """Every GPU against the median of its model (name and dtype) in this run, and its peak; the
    slow first, then by node and local rank. ``health``: node -> its preflight's gpu_health."""
    groups: dict = {}
    for m in measures:
        groups.setdefault((m.name, m.dtype), []).append(m)
    medians = {group: {key: statistics.median(m.rates[key] for m in ms if key in m.rates)
                       for key, _ in METRICS if any(key in m.rates for m in ms)}
               for group, ms in groups.items()}
    verdicts = []
    for m in measures:
        facts = health_of(m, health.get(m.node) or [])
        median = medians[(m.name, m.dtype)]
        vs_median = {k: v / median[k] for k, v in m.rates.items() if median.get(k)}
        vs_peak = {k: m.rates[k] / peak for k, peak in peaks_of(m.name, m.dtype, facts).items() if k in m.rates}
        why = [f"{label} {vs_median[k]:.2f}× the median of its model" for k, label in METRICS
               if vs_median.get(k, 1.0) < SLOW_RATIO]
        why += [f"{label} {vs_peak[k]:.2f}× its data-sheet peak" for k, label in METRICS
                if vs_peak.get(k, 1.0) < PEAK_FLOOR]
        verdicts.append(Verdict(m, facts, vs_median, vs_peak, tuple(why)))
    return sorted(verdicts, key=lambda v: (not v.slow, v.measured.node, v.measured.local_rank))


def _cell(verdict: Verdict, key: str) -> Text:
    rate = verdict.measured.rates.get(key)
    if rate is None:
        return Text("-")
    cell = Text(f"{rate:,.1f}")
    ratios = f" {verdict.vs_median[key]:.2f}" if key in verdict.vs_median else " -"
    ratios += f" {verdict.vs_peak[key]:.2f}" if key in verdict.vs_peak else " -"
    low = verdict.vs_median.get(key, 1.0) < SLOW_RATIO or verdict.vs_peak.get(key, 1.0) < PEAK_FLOOR
    return cell + Text(ratios, style="bold red" if low else "dim")


def render(verdicts: list[Verdict], labels: list[str]) -> Table:
    table = Table(title="every GPU measured at once (each figure: its value, × the median of its model, × its "
                        "data-sheet peak)", title_justify="left")
    for column in ("node", "host", "GPU", "model", *(label for _, label in METRICS), ""):
        table.add_column(column, no_wrap=True, justify="right" if column in dict(METRICS).values() else "left")
    for v in verdicts:
        m = v.measured
        model = f"{m.name} ({m.dtype})" if m.dtype != "bfloat16" else m.name
        state = Text(m.error or "slow", style="bold red") if v.slow else Text("ok", style="green")
        table.add_row(str(m.node), outside(labels[m.node] if m.node < len(labels) else "?"),
                      "-" if v.gpu is None else str(v.gpu), outside(model), *(_cell(v, k) for k, _ in METRICS),
                      state)
    return table


def slow_lines(verdicts: list[Verdict], labels: list[str]) -> list[str]:
    """One line a slow GPU, with why, and what nvidia-smi said about it at the preflight."""
    lines = []
    for v in verdicts:
        if not v.slow:
            continue
        where = f"{labels[v.measured.node] if v.measured.node < len(labels) else '?'} GPU " \
                f"{'?' if v.gpu is None else v.gpu}"
        why = v.measured.error or "; ".join(v.why)
        lines.append(f"{where}: {why}. nvidia-smi: {describe(v.health) if v.health else 'no answer'}")
    return lines


def warm_text(verdicts: list[Verdict]) -> str | None:
    """On how many GPUs the probe was forked from a warm interpreter (as the ranks said), where any was."""
    warm = sum(1 for v in verdicts if v.measured.warm)
    return f"the probe forked from a warm interpreter for {warm} of {len(verdicts)} GPU(s)" if warm else None


def records(verdicts: list[Verdict], labels: list[str]) -> list[dict]:
    """--json: one object a GPU."""
    return [{"node": v.measured.node, "host": labels[v.measured.node] if v.measured.node < len(labels) else None,
             "local_rank": v.measured.local_rank, "gpu": v.gpu, "uuid": v.measured.uuid, "model": v.measured.name,
             "dtype": v.measured.dtype, **v.measured.rates, "vs_median": v.vs_median, "vs_peak": v.vs_peak,
             "slow": v.slow, "why": list(v.why), "error": v.measured.error, "seconds": v.measured.seconds,
             "warm": v.measured.warm, "health": v.health}
            for v in verdicts]
