"""ddp-check --gpus: the probe's arithmetic, the reading of its reports (a rank's output: hostile
input), and the outlier rule, with fixed figures; then the H200's own report, judged again."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from orchestrator.config.clusterfile import parse_cluster
from orchestrator.diagnose import gpuspeed
from orchestrator.plan.launch import make_plan
from orchestrator.diagnose.gpuspeed import Measured
from orchestrator.node.probes import gpuhealth

DATA = Path(__file__).parent.parent / "data" / "gpu" / "health"
H100 = "NVIDIA H100 80GB HBM3"


def probe():
    """gpu_probe.py as the ranks run it (it imports torch only in main)."""
    path = Path(gpuspeed.__file__).parent / "gpu_probe.py"
    spec = importlib.util.spec_from_file_location("gpu_probe_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_round_fills_about_its_time_whatever_the_gpu_and_the_best_round_counts():
    p = probe()
    assert p.calls_per_round(0.0014) == 14  # an H100's 8192² bf16 matmul: 1.4 ms
    assert p.calls_per_round(0.2) == 1  # an fp32 matmul on an old GPU: one call a round
    assert p.calls_per_round(0.0) == p.MAX_CALLS and p.calls_per_round(1e-6) == p.MAX_CALLS
    flops = 2 * 8192 ** 3
    assert p.best_rate(flops, 10, [0.016, 0.014, 0.015]) == pytest.approx(flops * 10 / 0.014)
    assert p.best_rate(flops, 10, [0.0]) == 0.0


def report(**fields) -> str:
    return gpuspeed.REPORT + json.dumps({"rank": 0, "local_rank": 0, "name": H100, "dtype": "bfloat16",
                                         "tflops": 780.0, "copy_gbs": 3000.0, "h2d_gbs": 53.0, **fields})


def test_a_report_is_read_field_by_field_and_anything_else_is_not_one():
    m = gpuspeed.read_report(2, report(uuid="GPU-1"))
    assert (m.node, m.local_rank, m.name, m.uuid, m.dtype) == (2, 0, H100, "GPU-1", "bfloat16")
    assert m.rates == {"tflops": 780.0, "copy_gbs": 3000.0, "h2d_gbs": 53.0}
    for line in ("loss 0.3", gpuspeed.REPORT + "{not json", gpuspeed.REPORT + "[1, 2]",
                 report(local_rank="0"), report(local_rank=True)):
        assert gpuspeed.read_report(0, line) is None, line
    odd = gpuspeed.read_report(0, report(tflops=float("nan"), copy_gbs=-1, h2d_gbs=True, name="x" * 5000,
                                         dtype="int8", error={"no": 1}))
    assert odd.rates == {} and len(odd.name) == gpuspeed.MAX_TEXT and odd.dtype == "bfloat16" and odd.error is None
    assert gpuspeed.read_report(0, report(error="no NVIDIA GPU on this node", no_gpu=True)).no_gpu


def measured(node, local, tflops=780.0, copy=3000.0, h2d=53.0, name=H100, uuid=None):
    return Measured(node=node, local_rank=local, name=name, uuid=uuid,
                    rates={"tflops": tflops, "copy_gbs": copy, "h2d_gbs": h2d})


def test_a_gpu_30_percent_slower_than_its_peers_is_named_first_with_why_and_the_others_are_not():
    gpus = [measured(0, 0), measured(0, 1, tflops=790.0), measured(1, 0, tflops=546.0), measured(1, 1, tflops=770.0)]
    verdicts = gpuspeed.judge(gpus, {})
    assert [(v.measured.node, v.measured.local_rank, v.slow) for v in verdicts] == \
        [(1, 0, True), (0, 0, False), (0, 1, False), (1, 1, False)]
    assert verdicts[0].why == ("matmul TFLOPs 0.70× the median of its model",)
    assert verdicts[0].vs_peak["tflops"] == pytest.approx(546 / 989)


def test_the_median_is_of_the_same_model_and_a_gpu_alone_is_judged_by_its_peak():
    gpus = [measured(0, 0), measured(1, 0, tflops=300.0, copy=1900.0, h2d=25.0, name="NVIDIA A100-SXM4-80GB")]
    assert not any(v.slow for v in gpuspeed.judge(gpus, {}))  # an A100 is not a slow H100
    [alone] = gpuspeed.judge([measured(0, 0, tflops=400.0)], {})
    assert alone.why == ("matmul TFLOPs 0.40× its data-sheet peak",)
    [unknown] = gpuspeed.judge([measured(0, 0, tflops=1.0, name="Some Future GPU")], {})
    assert not unknown.slow and unknown.vs_peak == {}


def test_the_host_link_peak_is_the_slots_and_a_narrow_link_shows_against_it():
    [facts] = gpuhealth.parse_health((DATA / "h100" / "smi-health.csv").read_text())
    assert gpuspeed.peaks_of(H100, "bfloat16", facts) == {"tflops": 989.0, "copy_gbs": 3350.0,
                                                          "h2d_gbs": pytest.approx(63.0, abs=0.1)}
    assert gpuspeed.peaks_of(H100, "float32", {})["tflops"] == 67.0
    assert gpuspeed.peaks_of("NVIDIA H100 PCIe", "bfloat16", {})["tflops"] == 756.0
    [v] = gpuspeed.judge([measured(0, 0, uuid=facts["uuid"], h2d=26.0)], {0: [facts]})
    assert v.gpu == 0 and v.why == ("host→GPU GB/s 0.41× its data-sheet peak",)
    assert "nothing wrong by nvidia-smi" in gpuspeed.slow_lines([v], ["a"])[0]


def test_each_rank_is_matched_to_its_gpu_by_uuid_not_by_order():
    rows = [dict(index=0, uuid="GPU-a"), dict(index=1, uuid="GPU-b")]
    assert gpuspeed.health_of(measured(0, 0, uuid="GPU-b"), rows)["index"] == 1
    assert gpuspeed.health_of(measured(0, 1), rows)["index"] == 1  # no uuid: the job's order
    assert gpuspeed.health_of(measured(0, 0, uuid="GPU-z"), rows) == {}


def test_the_h200s_own_report_is_judged_again_as_it_was_there():
    [record] = [json.loads(line) for line in (DATA / "h200" / "check-gpus.json").read_text().splitlines()]
    line = gpuspeed.REPORT + json.dumps({"local_rank": 0, "name": record["model"], "uuid": record["uuid"],
                                         "dtype": record["dtype"], "tflops": record["tflops"],
                                         "copy_gbs": record["copy_gbs"], "h2d_gbs": record["h2d_gbs"]})
    [v] = gpuspeed.judge([gpuspeed.read_report(0, line)], {0: [record["health"]]})
    assert not v.slow and v.gpu == 0
    assert v.vs_peak == pytest.approx(record["vs_peak"])
    assert 0.75 < v.vs_peak["tflops"] < 0.9  # 805 of 989 TFLOPs
    [again] = gpuspeed.records([v], ["gpu0"])
    assert json.loads(json.dumps(again))["slow"] is False


def test_the_measure_runs_one_process_per_gpu_under_ddp_ups_own_launcher_whatever_the_file_says():
    config = parse_cluster("nodes: [{host: a, gpus: 4}, {host: b, gpus: 2}]\nlauncher: accelerate\n")
    plan = gpuspeed.measure_plan(config, "J", "/")
    assert plan.launcher == "none" and plan.world_size == 6 and plan.allow_unhealthy_gpus
    argv = plan.launcher_argv(plan.nodes[1], 29500)
    assert argv[-2:] == ["-m", gpuspeed.MODULE] and f"{gpuspeed.MODULE}.py" in plan.hooks


@pytest.mark.parametrize("launcher", ["torchrun", "none", "accelerate"])
def test_the_probes_are_forked_warm_with_torch_alone_whatever_the_launcher(launcher):
    config = parse_cluster(f"nodes: [{{host: a, gpus: 2}}]\nlauncher: {launcher}\npreload: [lightning]\n")
    plan = gpuspeed.measure_plan(config, "J", "/")
    assert plan.warms and plan.preload == ()
    [spec] = [plan.agent_spec(node) for node in plan.nodes]
    assert spec.warm and not spec.preload


def test_a_node_without_an_nvidia_gpu_imports_no_torch_for_the_measure(monkeypatch):
    """Its probe says "no NVIDIA GPU" before importing torch: a warm interpreter there would import
    it in vain. A job's own spec is warm on every node alike."""
    from orchestrator.node.probes import facts
    from orchestrator.node.attempt import placement

    config = parse_cluster("nodes: [{host: a, gpus: 2}]\n")
    plan = gpuspeed.measure_plan(config, "J", "/")
    spec, job = plan.agent_spec(plan.nodes[0]), make_plan(config, "train.py", [], "J", "/").agent_spec(plan.nodes[0])
    assert spec.warm and spec.warm_gpus_only and job.warm and not job.warm_gpus_only
    for gpus, expected in ((True, True), (False, False)):
        monkeypatch.setattr(facts, "has_nvidia_gpus", lambda gpus=gpus: gpus)
        assert placement.warm_here(spec) is expected
        assert placement.warm_here(job) is True


def test_warm_false_keeps_the_measure_cold():
    config = parse_cluster("nodes: [{host: a, gpus: 2}]\nwarm: false\n")
    assert not gpuspeed.measure_plan(config, "J", "/").warms


def test_a_ranks_word_on_its_warm_start_reaches_the_json_and_the_line_under_the_table():
    warm = gpuspeed.read_report(0, gpuspeed.REPORT + json.dumps({"local_rank": 0, "name": "H200", "warm": True,
                                                                 "tflops": 800.0}))
    cold = gpuspeed.read_report(0, gpuspeed.REPORT + json.dumps({"local_rank": 1, "name": "H200", "warm": "yes",
                                                                 "tflops": 800.0}))
    assert warm.warm and not cold.warm  # only a JSON true counts: the line is the rank's output
    verdicts = gpuspeed.judge([warm, cold], {})
    assert [r["warm"] for r in gpuspeed.records(verdicts, ["a"])] == [True, False]
    assert gpuspeed.warm_text(verdicts) == "the probe forked from a warm interpreter for 1 of 2 GPU(s)"
    assert gpuspeed.warm_text(gpuspeed.judge([cold], {})) is None


def test_a_slow_gpu_stops_a_launch_that_asked_for_the_measure_unless_allowed(monkeypatch, capsys):
    from rich.console import Console

    from orchestrator.commands import gpus
    slow = gpuspeed.judge([measured(0, 0), measured(0, 1), measured(0, 2, tflops=500.0)], {})
    found = gpus.GpuMeasure(["a"], verdicts=slow)
    monkeypatch.setattr(gpus, "measure", lambda *args: found)
    console = Console(file=open("/dev/null", "w"), width=200)
    assert gpus.gate(None, console, None, allowed=False) == 3
    assert gpus.gate(None, console, None, allowed=True) is None
    found.verdicts = slow[1:]
    assert gpus.gate(None, console, None, allowed=False) is None
    monkeypatch.setattr(gpus, "measure", lambda *args: gpus.GpuMeasure(["a"], failure="rank 0 exited with code 1",
                                                                          missing=1))
    assert gpus.gate(None, console, None, allowed=True) == 3  # a measure that failed is no measure
    monkeypatch.setattr(gpus, "measure", lambda *args: gpus.GpuMeasure(["a"], no_gpu=True))
    assert gpus.gate(None, console, None, allowed=False) is None
