"""ddp-fetch on the sshd cluster: files back from every node over OpenSSH, during a run and after it,
changed files only; a path missing on the nodes is one message."""

from __future__ import annotations

import json
import re
import os
import signal

from tests.harness.runner import FETCH, Launch
from tests.integration.conftest import SCRIPT


def fetch(*args: str) -> tuple[int, str]:
    launch = Launch(list(args), code=FETCH)
    return launch.wait(60), launch.output


def test_files_come_back_from_every_node_during_and_after_a_run(cluster, cluster_file, tmp_path):
    path = cluster_file([(0, 1), (1, 1)], launcher="none")
    ckpt = tmp_path / "ckpt"
    (ckpt / "step-1").mkdir(parents=True)
    (ckpt / "step-1" / "model.pt").write_bytes(os.urandom(5 << 20))
    (ckpt / "latest").symlink_to("step-1")
    job = Launch([str(path), SCRIPT, "tick", "600", "0.1"])
    try:
        job.wait_line(r"tick 3 rank=1", 90)
        code, out = fetch(str(path), "ckpt", str(tmp_path / "out"), "--json")  # while it runs
        assert code == 0, out
        rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert [(r["node"], r["files"], r["links"], r["error"]) for r in rows] == [
            (cluster.nodes[0].addr, 1, 1, None), (cluster.nodes[1].addr, 1, 1, None)], out
        for node in cluster.nodes[:2]:
            here = tmp_path / "out" / node.addr / "ckpt"
            assert (here / "step-1" / "model.pt").read_bytes() == (ckpt / "step-1" / "model.pt").read_bytes()
            assert os.readlink(here / "latest") == "step-1"
    finally:
        job.signal(signal.SIGINT)
        assert job.wait(60) == 130, job.output
    (ckpt / "step-1" / "extra.json").write_text("{}")
    code, out = fetch(str(path), "ckpt", str(tmp_path / "out"), "--json", "--node", "1")  # after it, one node
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert code == 0 and [(r["files"], r["unchanged"]) for r in rows] == [(2, 0)], out  # its own folder: new
    code, out = fetch(str(path), "ckpt", str(tmp_path / "out"), "--json")
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert code == 0 and [(r["files"], r["bytes"]) for r in rows] == [(1, 2), (1, 2)], out  # only what changed
    code, out = fetch(str(path), "no/such/thing", str(tmp_path / "out"))
    assert code == 3 and "cannot read" in out and "No such file or directory" in out and "Traceback" not in out, out


def test_the_cluster_files_fetch_key_brings_outputs_back_when_the_job_ends(cluster, cluster_file, tmp_path):
    from tests.harness.runner import ddp_up, run_dir

    path = cluster_file([(0, 1), (1, 1)], launcher="none", fetch=["ckpt", "missing.txt"])
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "final.pt").write_bytes(b"weights")
    code, out, _ = ddp_up(str(path), SCRIPT, "tick", "2", "0.1")
    assert code == 0, out
    job = re.search(r"job (\S+):", out).group(1)
    for node in cluster.nodes[:2]:
        assert (run_dir(job) / "fetched" / node.addr / "ckpt" / "final.pt").read_bytes() == b"weights"
    assert "fetched ckpt, missing.txt from 2 node(s) into" in out and "2 file(s) copied" in out, out
    assert "cannot fetch from " in out and "missing.txt: No such file or directory" in out, out  # said, not fatal
    record = json.loads((run_dir(job) / "fetched.json").read_text())
    assert sorted((r["node"], r["files"], r["error"] is None) for r in record)[:2] == [
        (cluster.nodes[0].addr, 0, False), (cluster.nodes[0].addr, 1, True)], record
