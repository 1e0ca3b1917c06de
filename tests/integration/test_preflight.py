"""Issue 5 (preflight part): jobs that cannot start fail in seconds, before any training process."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

from tests.harness.runner import ddp_check, ddp_up
from tests.integration.conftest import SCRIPT

TICK = ["tick", "1", "0"]  # one line a rank, without torch: where the subject is what comes before the ranks


def with_node_keys(path, cluster, index: int, extra: str) -> None:
    """Append YAML keys (two-space indented lines) to one node's entry of a cluster file."""
    head = f"- host: {cluster.nodes[index].addr}\n  gpus: 1"
    text = path.read_text()
    assert head in text
    path.write_text(text.replace(head, head + "\n" + extra))


def test_unreachable_master_address_is_caught_before_start(cluster, cluster_file):
    path = cluster_file([(0, 1), (1, 1)], master={"addr": f"{cluster.net}.200"}, launcher="none")  # nobody there
    code, out, seconds = ddp_up(str(path), SCRIPT, "tick", "1", "0")
    assert code == 3, out
    for node in cluster.nodes[:2]:
        assert re.search(rf"{node.addr}: cannot reach the master at {cluster.net}\.200:\d+ ", out), out
    assert "tick 0" not in out and "nothing was started" in out
    code, out = ddp_check(str(path), SCRIPT)
    assert code == 3 and f"cannot reach the master at {cluster.net}.200" in out, out


def test_torch_version_mismatch_is_caught_before_start(cluster, cluster_file, tmp_path):
    fake = tmp_path / "fake-site"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text("")
    (fake / "torch-9.9.9.dist-info").mkdir()
    (fake / "torch-9.9.9.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 9.9.9\n")
    path = cluster_file([(0, 1), (1, 1)])
    with_node_keys(path, cluster, 1, f"  env: {{PYTHONPATH: {fake}}}")
    code, out, _ = ddp_up(str(path), SCRIPT, "run")
    assert code == 3, out
    assert re.search(rf"{cluster.nodes[1].addr}: torch 9\.9\.9 here, torch \S+ on the master", out), out
    assert "READY" not in out


def test_ddp_check_reports_every_node(cluster, cluster_file, tmp_path):
    path = cluster_file([(0, 1), (1, 1), (2, 1)])
    code, out = ddp_check(str(path), SCRIPT)
    assert code == 0, out
    for i, node in enumerate(cluster.nodes[:3]):
        assert re.search(rf"│ {i}\s+│ {re.escape(node.addr)}\s+│ ✓\s+│ 2\.13\.0", out), out
    shutil.copy(SCRIPT, tmp_path / "job.py")  # nodes 0 and 1 run in tmp_path: they have it
    empty = tmp_path / "empty"
    empty.mkdir()
    with_node_keys(path, cluster, 2, f"  workdir: {empty}")  # node 2 does not
    code, out = ddp_check(str(path), "job.py")
    assert code == 3, out
    assert re.search(rf"│ 1\s+│ {re.escape(cluster.nodes[1].addr)}\s+│ ✓", out), out
    assert re.search(rf"│ 2\s+│ {re.escape(cluster.nodes[2].addr)}\s+│ ✗", out), out
    assert f"{cluster.nodes[2].addr}: script job.py not found in {empty}" in out, out


def test_node_without_torch_is_caught_by_both_commands(cluster, cluster_file, tmp_path):
    venv = tmp_path / "bare-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    path = cluster_file([(0, 1), (1, 1)])
    with_node_keys(path, cluster, 1, f"  python: {venv}/bin/python")
    code, out, _ = ddp_up(str(path), SCRIPT, "run")
    assert code == 3 and f"{cluster.nodes[1].addr}: torch is not installed for {venv}/bin/python" in out, out
    code, out = ddp_check(str(path), SCRIPT)
    assert code == 3 and f"{cluster.nodes[1].addr}: torch is not installed for {venv}/bin/python" in out, out


def test_ddp_check_names_wrong_python_and_workdir(cluster, cluster_file):
    path = cluster_file([(0, 1), (1, 1), (2, 1)])
    with_node_keys(path, cluster, 1, "  python: /nope/python3")
    with_node_keys(path, cluster, 2, "  workdir: /nope/dir")
    code, out = ddp_check(str(path), SCRIPT)
    assert code == 3, out
    assert f"{cluster.nodes[1].addr}: python not found: '/nope/python3'" in out, out
    assert f"{cluster.nodes[2].addr}: workdir /nope/dir does not exist" in out, out
    assert re.search(rf"│ 0\s+│ {re.escape(cluster.nodes[0].addr)}\s+│ ✓", out), out


def test_gpus_auto_takes_the_count_the_job_would_see(cluster, cluster_file):
    path = cluster_file([(0, 1), (1, "auto"), (2, "auto")], launcher="none",  # the count, not who starts the ranks
                        env={"OMP_NUM_THREADS": 1, "TICK_SAYS_WORLD": 1})  # the ranks say their world, without torch
    text = path.read_text()
    for i, visible in ((1, "0,1"), (2, "")):  # node 2: CUDA_VISIBLE_DEVICES hides every GPU
        head = f"- host: {cluster.nodes[i].addr}\n  gpus: auto"
        assert head in text
        text = text.replace(head, f"{head}\n  env: {{CUDA_VISIBLE_DEVICES: '{visible}'}}")
    path.write_text(text)
    code, out, _ = ddp_up(str(path), SCRIPT, *TICK)
    assert code == 3, out
    assert f"{cluster.nodes[2].addr}: gpus: auto, but the job would see no GPU here" in out, out
    assert f"{cluster.nodes[1].addr}:" not in out and "WORLD" not in out
    # The count is taken after the node's `setup:`, which may choose the GPUs itself.
    path.write_text(text.replace("env: {CUDA_VISIBLE_DEVICES: ''}", "setup: ['export CUDA_VISIBLE_DEVICES=3,4']"))
    code, out, _ = ddp_up(str(path), SCRIPT, *TICK)
    assert code == 0, out
    assert re.search(r"r2 +\| WORLD 5 rank=2 ", out) and "WORLD 5 rank=4 " in out, out
    path.write_text(text.replace("env: {CUDA_VISIBLE_DEVICES: ''}", "setup: ['module load cuda']"))
    code, out, _ = ddp_up(str(path), SCRIPT, *TICK)
    assert code == 3 and f"{cluster.nodes[2].addr}: setup command 1 `module load cuda` failed with status 127" in out, out


def test_setup_commands_shape_the_job_environment_and_a_failure_stops_everything(cluster, cluster_file):
    path = cluster_file([(0, 1), (1, 1)], launcher="none",
                        setup=["read -r line || true",  # must not eat the agent's source
                               "echo 'W O 0 99999'",  # nor print into its frames
                               "export FROM_SETUP=yes-$(hostname)"])
    code, out, _ = ddp_up(str(path), SCRIPT, "env", "FROM_SETUP")
    assert code == 0 and re.search(r"~ W O 0 99999$", out, re.M), out  # shown as the node's own output
    for i, node in enumerate(cluster.nodes[:2]):
        assert re.search(rf"r{i} +\| ENV FROM_SETUP=yes-{node.name}$", out, re.M), out
    with_node_keys(path, cluster, 1, "  setup: ['echo preparing', 'ls /no/such/dir', 'echo never']")
    code, out, seconds = ddp_up(str(path), SCRIPT, "run")
    assert code == 3, out
    assert re.search(rf"{cluster.nodes[1].addr}: setup command 2 `ls /no/such/dir` failed with status 2: "
                     r".*No such file or directory", out), out
    assert "READY" not in out and "never" not in out
