"""Issue 7 (node lists): MPI/DeepSpeed hostfiles and horovod's -H, on the sshd cluster, with a
cluster file that holds only the other settings (SSH key, python, workdir)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import yaml

from tests.harness.runner import ddp_check, ddp_kill, ddp_up, run_dir
from tests.integration.conftest import SCRIPT

LAUNCHER = "none"  # torchrun is not what these tests are about (see conftest.cluster_file)


def settings_file(cluster, tmp_path):
    """A cluster file with no `nodes:`: the node option gives them (and no torchrun, as LAUNCHER says);
    the torch-free `tick` workload says each rank's world size."""
    path = tmp_path / "settings.yaml"
    path.write_text(yaml.safe_dump({
        "ssh": {"user": "root", "identity_file": str(cluster.client_key), "known_hosts": str(cluster.known_hosts),
                "connect_timeout": 5},
        "python": sys.executable, "workdir": str(tmp_path), "env": {"OMP_NUM_THREADS": 1, "TICK_SAYS_WORLD": 1},
        "launcher": LAUNCHER}))
    return path


def test_horovod_host_list_runs_the_job(cluster, tmp_path):
    a, b = cluster.nodes[0].addr, cluster.nodes[1].addr
    code, out, _ = ddp_up("-H", f"{a}:2,{b}:1", str(settings_file(cluster, tmp_path)), SCRIPT, "tick", "1", "0")
    assert code == 0, out
    for rank in range(3):
        assert f"WORLD 3 rank={rank} " in out, out
    assert re.search(rf"{re.escape(b)} +r2 +\| WORLD 3 rank=2", out), out


def test_hostfile_with_comments_for_ddp_up_check_and_kill(cluster, tmp_path):
    hosts = tmp_path / "hostfile"
    hosts.write_text(f"# two nodes, DeepSpeed style\n{cluster.nodes[2].addr} slots=1\n\n"
                     f"{cluster.nodes[3].addr} slots=2   # the second one\n")
    settings = str(settings_file(cluster, tmp_path))
    code, out = ddp_check("--hostfile", str(hosts), settings, SCRIPT)
    assert code == 0, out
    code, out, _ = ddp_up("--hostfile", str(hosts), settings, SCRIPT, "tick", "1", "0")
    assert code == 0 and re.search(rf"{re.escape(cluster.nodes[3].addr)} +r2 +\| WORLD 3 rank=2", out), out
    code, out = ddp_kill("--hostfile", str(hosts), settings)
    assert code == 0 and cluster.nodes[3].addr in out, out
    hosts.write_text(f"{cluster.nodes[2].addr} slots=two\n")
    code, out, _ = ddp_up("--hostfile", str(hosts), settings, SCRIPT, "tick", "1", "0")
    assert code == 2 and f"{hosts}:1: slots: slots must be an integer from 1 to 4096, got 'two'" in out, out


LEGACY = str(Path(SCRIPT).with_name("legacy.py"))


def test_old_style_script_runs_under_each_launcher(cluster_file):
    """legacy passes --local_rank=N; torchrun and none (no torchrun: ddp-up starts the workers)
    set only the environment, which the script reads as well."""
    home = os.path.expanduser("~")
    python = "~" + sys.executable[len(home):] if sys.executable.startswith(home + "/") else sys.executable
    for launcher, shown in (("legacy", lambda r: str(r)), ("torchrun", lambda r: "None"), ("none", lambda r: "None")):
        path = cluster_file([(0, 2), (1, 1)], launcher=launcher, python=python)  # `~/` is the node's home
        code, out, _ = ddp_up(str(path), LEGACY, "--tag", "a b")
        assert code == 0, out
        for rank, local in ((0, 0), (1, 1), (2, 0)):
            assert f"LEGACY rank={rank} local_rank_arg={shown(local)} local_rank_env={local} tag=a b" in out, out


def test_launcher_none_fails_fast_and_names_the_rank(cluster, cluster_file):
    """Without torchrun, one failing worker still stops its node-mates and the job at once, and
    the report names node, rank and exit code as it does under torchrun."""
    path = cluster_file([(0, 1), (1, 2)], launcher="none")
    code, out, _ = ddp_up(str(path), SCRIPT, "tick", "100", "0.2", "2", "3")  # rank 2 exits 3 at its third tick
    assert code == 1, out
    b = re.escape(cluster.nodes[1].addr)
    assert re.search(rf"root cause: {b} \(node 1, rank 2\): rank 2 exited with code 3", out), out
    assert re.search(rf"^{b}\s+r2\s+! rank 2 failing with 3$", out, re.M), out
    assert "tick 99 rank=" not in out, "the other ranks ran to the end instead of being stopped"


def test_env_file_forwarded_variables_and_secrets(cluster_file, tmp_path, monkeypatch):
    token = "hf_s3cr3t_value_123"
    (tmp_path / "job.env").write_text("# from the team's .env\nexport FROM_FILE='file value'\nHF_TOKEN=overridden\n")
    monkeypatch.setenv("HF_TOKEN", token)
    monkeypatch.setenv("WANDB_PROJECT", "demo")
    monkeypatch.setenv("NOT_FORWARDED", "local only")
    path = cluster_file([(0, 1), (1, 1)], env_file="job.env", forward_env=["HF_TOKEN", "WANDB_*"])
    code, out, _ = ddp_up(str(path), SCRIPT, "env", "FROM_FILE", "HF_TOKEN", "WANDB_PROJECT", "NOT_FORWARDED")
    assert code == 0, out
    for rank in (0, 1):
        assert re.search(rf"r{rank} +\| ENV FROM_FILE=file value$", out, re.M), out
        assert re.search(rf"r{rank} +\| ENV HF_TOKEN=\*\*\*$", out, re.M), out  # forwarded, and masked
        assert re.search(rf"r{rank} +\| ENV WANDB_PROJECT=demo$", out, re.M), out
        assert re.search(rf"r{rank} +\| ENV NOT_FORWARDED=<unset>$", out, re.M), out
    job = re.search(r"job (\d{8}-\d{6}-\w+)", out).group(1)
    logs = "".join(p.read_text() for p in run_dir(job).glob("*"))
    assert "ENV HF_TOKEN=***" in logs and token not in logs and token not in out
    code, out, _ = ddp_up("--dry-run", str(path), SCRIPT, "env")
    assert code == 0 and "HF_TOKEN=***" in out and token not in out, out
    monkeypatch.delenv("HF_TOKEN")  # a new shell at 3 a.m.: stopping jobs must not need the token
    code, out = ddp_kill(str(path))
    assert code == 0, out
