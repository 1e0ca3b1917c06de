"""Issue 28: the collective a job is stuck in, the rank everyone waits for, and the slow node, from
torch's Flight Recorder (gloo on CPU), on the sshd cluster."""

from __future__ import annotations

import json
import re

import pytest

from tests.harness.runner import ddp_up, run_dir
from tests.integration.conftest import SCRIPT

LAUNCHER = "none"  # the records are the ranks', whatever starts them (see conftest.cluster_file)

HANG_TIMEOUT = 12  # the mismatch test: ranks print every step, so only the stuck collective is silence


def summary(out: str) -> tuple[str, dict]:
    job = re.search(r"job (\d{8}-\d{6}-\w+)", out).group(1)
    return job, json.loads((run_dir(job) / "summary.json").read_text())


def test_a_collective_timeout_names_the_rank_that_never_entered_it_and_keeps_the_users_buffer(cluster, cluster_file):
    """Rank 2 never calls step 3's all_reduce; ranks 0-1 die of gloo's 8 s timeout in it. The
    user's own TORCH_FR_BUFFER_SIZE is what the ranks see."""
    path = cluster_file([(0, 2), (1, 1)], stop_grace=3,
                        env={"OMP_NUM_THREADS": 1, "JOB_PG_TIMEOUT": 8, "TORCH_FR_BUFFER_SIZE": 64})
    code, out, _ = ddp_up(str(path), SCRIPT, "collectives", "skip", "10", "0.1", timeout=120)
    assert code == 1, out
    assert len(re.findall(r"FR_BUFFER=64 rank=\d$", out, re.M)) == 3, out
    b = re.escape(cluster.nodes[1].addr)
    said = (rf"Flight Recorder: on the default group, every rank completed all_reduce #4; rank 2 \({b}\) never "
            r"entered all_reduce #5; ranks 0-1 wait in it\.")
    assert re.search(r"r[01] ! \[rank[01]\]: RuntimeError: .*Timed out waiting 8000ms", out), out
    assert re.search("collectives: " + said, out), out
    job, found = summary(out)
    assert re.fullmatch(said, found["collectives"]), found
    for rank in range(3):
        kept = json.loads((run_dir(job) / f"rank{rank}.collectives.json").read_text())
        assert kept["rank"] == rank and kept["entries"][-1]["op"] == "all_reduce", kept


def test_a_hang_at_mismatched_collectives_names_the_odd_rank(cluster, cluster_file):
    """Rank 2 calls all_gather where ranks 0-1 call all_reduce (#5): gloo hangs, the stacks look
    alike (inside torch); the records tell them apart."""
    path = cluster_file([(0, 1), (1, 2)], hang_timeout=HANG_TIMEOUT, stop_grace=3,
                        env={"OMP_NUM_THREADS": 1, "PATH": "/usr/bin:/bin"})
    code, out, _ = ddp_up(str(path), SCRIPT, "collectives", "mismatch", "10", "0.1", timeout=120)
    assert code == 1, out
    b = re.escape(cluster.nodes[1].addr)
    assert re.search(rf"root cause: {b} \(node 1, rank 2\): job hung \(no output from any rank for \d+ s\); rank 2 "
                     r"called all_gather #5 on the default group where the others called all_reduce \(Flight "
                     r"Recorder\)", out), out
    assert re.search(rf"collectives: Flight Recorder: on the default group, every rank completed all_reduce #4; at #5 "
                     rf"the ranks called different collectives: ranks 0-1 \(\S+\) all_reduce \[4\] Float; rank 2 "
                     rf"\({b}\) all_gather \[4\] Float\.", out), out


@pytest.mark.parametrize("nodes", [4])  # 2 nodes: the unit tests (the suite's time)
def test_a_rank_that_sleeps_before_each_step_is_named_a_straggler_and_no_one_else(cluster, cluster_file, nodes):
    path = cluster_file([(i, 1) for i in range(nodes)])
    code, out, _ = ddp_up(str(path), SCRIPT, "collectives", "slow", "45", "0.1", timeout=180)
    assert code == 0, out
    late = re.escape(cluster.nodes[nodes - 1].addr)
    assert re.findall(r"ddp-up (\S+) is a straggler", out) == [cluster.nodes[nodes - 1].addr], out
    m = re.search(rf"ddp-up {late} is a straggler: rank {nodes - 1} arrives last at (\d+)% of the job's collectives, "
                  r"(\d+) ms after the others", out)
    assert m and int(m.group(1)) >= 60 and 250 <= int(m.group(2)) <= 400, out
    assert re.search(rf"straggler: {late} \(node {nodes - 1}, rank {nodes - 1}\): late \d+ ms at \d+% of collectives",
                     out), out
    figures = [n["collectives"] for n in summary(out)[1]["nodes"]]
    assert [f["straggler"] for f in figures] == [False] * (nodes - 1) + [True], figures


def test_a_balanced_job_names_no_straggler(cluster, cluster_file):
    # 250 steps of 0.05 s: over two of the agents' reads (every 5 s), so that enough collectives are compared
    path = cluster_file([(0, 1), (1, 1), (2, 1)])
    code, out, _ = ddp_up(str(path), SCRIPT, "collectives", "balanced", "250", "0.05", timeout=180)
    assert code == 0, out
    assert "straggler" not in out, out
    figures = [n["collectives"] for n in summary(out)[1]["nodes"]]
    assert all(f["compared"] >= 10 and not f["straggler"] for f in figures), figures


def test_a_crafted_record_neither_crashes_nor_reaches_the_terminal(cluster, cluster_file):
    """Rank 1 prints a crafted record with terminal escapes and writes it over its own record
    file, again and again; rank 0 dies of the collective's timeout, and the end is diagnosed."""
    path = cluster_file([(0, 1), (1, 1)], stop_grace=3, env={"OMP_NUM_THREADS": 1, "JOB_PG_TIMEOUT": 8})
    code, out, _ = ddp_up(str(path), SCRIPT, "collectives", "crafted", "10", "0.1", timeout=120)
    assert code == 1, out
    assert "\x1b" not in out and "\x07" not in out
    assert "collectives: Flight Recorder:" in out and "Traceback" not in out.split("root cause:")[1], out
