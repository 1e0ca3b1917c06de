"""ddp-check --gpus where there is no GPU (CI, and the CPU nodes of a mixed cluster): it says so
and passes, over real SSH. The GPU path itself ran on an H200: tests/data/gpu/health/h200/."""

from __future__ import annotations

from tests.harness.runner import ddp_check


def test_gpus_on_nodes_without_a_gpu_says_there_is_nothing_to_measure_and_passes(cluster, cluster_file):
    path = cluster_file([(0, 1), (1, 2)])
    code, out = ddp_check("--gpus", str(path), timeout=120)
    assert code == 0, out
    assert "every GPU of 2 node(s) measured at once" in out, out
    assert "no NVIDIA GPU on any node: nothing to measure" in out, out
    assert "Traceback" not in out
