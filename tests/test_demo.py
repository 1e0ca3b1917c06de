"""The README's first command: the embedded 2-node localhost demo, for real (torch + gloo)."""

import re

from tests.harness import procs
from tests.harness.runner import ddp_up


def test_local_demo_runs_a_real_two_node_job():
    code, out, _ = ddp_up("configs/local.yaml", "examples/train.py", "--steps", "2", timeout=180)
    assert code == 0, out
    for rank, label in ((0, "local-a"), (1, "local-a"), (2, "local-b"), (3, "local-b")):
        assert re.search(rf"^{label} r{rank} \| rank {rank}/4 on .*: all_reduce ok \(10\)$", out, re.M), out
    assert "ok after" in out
    # nothing ddp-up causes: torch's deprecation warning for a Flight Recorder variable set twice,
    # NumPy's "Failed to initialize", any other warning a first run would show
    assert not re.search(r"warn|deprecat", out, re.I), out
    assert procs.wait_no_job_processes(None, 10) == []
