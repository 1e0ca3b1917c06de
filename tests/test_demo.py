"""The README's first command: the embedded 2-node localhost demo, for real (torch + gloo)."""

import csv
import re

from tests.harness import procs
from tests.harness.runner import ddp_up, run_dir


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
    # what it learned, with no change to the script: every "step N loss X" a rank printed is a row of
    # metrics.csv, rank by rank and step by step, and the page charts it first
    printed = {(int(rank), float(step), float(value)) for rank, step, value in
               re.findall(r"^local-\w r(\d) \| step (\d+) loss ([\d.]+)$", out, re.M)}
    job = run_dir(re.search(r"job (\d{8}-\d{6}-\w+)", out).group(1))
    with open(job / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {(int(r["rank"]), float(r["step"]), float(r["value"])) for r in rows if r["name"] == "loss"} == printed
    assert len(printed) == 4 * 2 and {r["name"] for r in rows} == {"loss"} and {r["attempt"] for r in rows} == {"0"}
    page = (job / "report.html").read_text()
    assert page.index("What the run learned") < page.index("The machine"), "the metrics come first"
