"""Issue 13 on real nodes: another local account, a reused job id, huge binary lines, a closed
stdout, and links in a node's workdir."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest
import yaml

from tests.harness import procs
from tests.harness.runner import REPO, Launch, _env, ddp_up, run_dir
from tests.integration.conftest import SCRIPT
from tests.integration.test_sync import sync_cluster
from tests.scripts.job import blob

LAUNCHER = "none"  # torchrun is not what these tests are about (see conftest.cluster_file)
LONG_RUN = ["tick", "100000", "0.2"]  # torch-free: the subject is what ddp-up writes and refuses


def as_nobody(code: str) -> subprocess.CompletedProcess:
    """Python as another local account (the system python: pyenv's lives under /root, 0700)."""
    return subprocess.run(["setpriv", "--reuid", "nobody", "--regid", "nogroup", "--clear-groups",
                           "/usr/bin/python3", "-c", code], capture_output=True, text=True, timeout=30)


@pytest.fixture
def shared_tmp():
    """A sticky, world-writable directory like /tmp, made by this test and removed after it."""
    path = tempfile.mkdtemp(prefix="ddp-up-shared-", dir="/tmp")
    os.chmod(path, 0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_a_state_directory_another_user_made_or_linked_is_refused_and_ours_is_private(cluster, cluster_file,
                                                                                    shared_tmp):
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux) for a second local account")
    # the nodes' TMPDIR is the shared directory: their python is a wrapper that sets it (a `setup:`
    # that exports TMPDIR moves the job's TMPDIR, not ddp-up's own state)
    python = os.path.join(shared_tmp, "python-with-tmpdir")
    with open(python, "w") as f:
        f.write(f"#!/bin/sh\nTMPDIR={shared_tmp} exec {sys.executable} \"$@\"\n")
    os.chmod(python, 0o755)
    path = cluster_file([(0, 1), (1, 1)], python=python)
    root = os.path.join(shared_tmp, f"ddp-up-{os.getuid()}")

    planted = as_nobody(f"import os; os.mkdir({root!r}, 0o777)")
    assert planted.returncode == 0, planted.stderr
    code, out, _ = ddp_up(str(path), SCRIPT, "env", "RANK")
    assert code == 3, out
    assert f"ddp-up's state directory {root} belongs to uid 65534, not to this user (uid 0); refusing" in out, out
    assert "ENV RANK" not in out

    outside = os.path.join(shared_tmp, "elsewhere")
    linked = as_nobody(f"import os; os.rmdir({root!r}); os.mkdir({outside!r}, 0o777); os.symlink({outside!r}, {root!r})")
    assert linked.returncode == 0, linked.stderr
    code, out, _ = ddp_up(str(path), SCRIPT, "env", "RANK")
    assert code == 3 and f"{root} is a symbolic link or not a directory" in out, out
    assert os.listdir(outside) == []  # nothing was written through the link

    os.unlink(root)
    launch = Launch([str(path), SCRIPT, *LONG_RUN])
    launch.wait_line(r"r0\s+\| tick 1 rank=0", 90)
    try:
        assert os.stat(root).st_mode & 0o777 == 0o700
        assert os.stat(os.path.join(root, launch.job_id)).st_mode & 0o777 == 0o700
        peek = as_nobody(f"import os; print(os.listdir({os.path.join(root, launch.job_id)!r}))")
        assert peek.returncode != 0 and "PermissionError" in peek.stderr  # logs and hooks out of reach
    finally:
        launch.signal(signal.SIGINT)
        assert launch.wait(30) == 130, launch.output
    assert not os.path.exists(os.path.join(root, launch.job_id))  # removed after the job


def test_a_job_id_in_use_is_refused_and_the_running_job_is_untouched(cluster, cluster_file, tmp_path):
    path = cluster_file([(0, 1), (1, 1)])
    first = Launch(["--job-id", "train-42", str(path), SCRIPT, *LONG_RUN])
    try:
        first.wait_line(r"r1\s+\| tick 1 rank=1", 90)
        code, out, _ = ddp_up("--job-id", "train-42", str(path), SCRIPT, *LONG_RUN)  # its run directory: refused here
        assert code == 2 and "already holds a run" in out, out
        code, out, _ = ddp_up("--runs-dir", str(tmp_path), "--job-id", "train-42", str(path), SCRIPT, *LONG_RUN)
        assert code == 3, out
        assert "job id train-42 is already in use on this node" in out, out
        assert "fix: pick another --job-id, or stop the other one first: ddp-kill CLUSTER.yaml --job train-42" in out
        assert first.proc.poll() is None and len(procs.job_processes("train-42")) >= 4
        first.wait_line(r"r0\s+\| tick 3 rank=0", 30)  # still running
    finally:
        first.signal(signal.SIGINT)
        assert first.wait(30) == 130, first.output
    assert not procs.wait_no_job_processes("train-42", 10)


def test_a_huge_binary_line_reaches_the_rank_log_byte_for_byte(cluster, cluster_file):
    size = 3_000_000  # three pieces on the wire
    path = cluster_file([(0, 1), (1, 1)], launcher="none")
    code, out, _ = ddp_up("--no-dashboard", str(path), SCRIPT, "blob", str(size))
    assert code == 0, out[-2000:]
    logs = run_dir(re.search(r"job (\S+):", out).group(1))
    for rank in (0, 1):
        assert (logs / f"rank{rank}.log").read_bytes() == b"start\n" + blob(size)
    shown = re.findall(r"\.\.\. \[([\d,]+) more characters of that line not shown; the whole line is in "
                       r"rank(\d)\.log\]", out)
    assert sorted(r for _, r in shown) == ["0", "1"], out[-2000:]
    assert "\x9b" not in out and "\x1b[2J" not in out  # C1 CSI and clear-screen never reach the terminal


@pytest.mark.parametrize("fail", [False, True])
def test_a_closed_stdout_does_not_stop_the_job_and_the_summary_says_what_was_returned(cluster, cluster_file,
                                                                                     tmp_path, fail):
    path = cluster_file([(0, 1), (1, 1)])
    args = ["tick", "30", "0.05"] + (["1", "7"] if fail else [])  # rank 1 exits 7 at its third line
    runs = tmp_path / "runs"
    job = f"J{int(fail)}"  # each its own: the two run at once on parallel workers, in one process table
    up = " ".join(map(repr, ["--no-dashboard", "--runs-dir", str(runs), "--job-id", job, str(path), SCRIPT, *args]))
    command = (f"{sys.executable} -c 'from orchestrator.commands.entry import up; up()' {up} | head -n 1; "
               "echo STATUS=${PIPESTATUS[0]} >&2")
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120, env=_env(), cwd=REPO)
    status = int(re.search(r"STATUS=(\d+)", done.stderr).group(1))
    assert status == (1 if fail else 0), done.stderr
    assert "stdout is gone" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert json.loads((runs / job / "summary.json").read_text())["exit_code"] == status
    if not fail:
        for rank in (0, 1):
            steps = re.findall(r"^tick (\d+) ", (runs / job / f"rank{rank}.log").read_text(), re.M)
            assert steps == [str(i) for i in range(30)]  # the job ran to its end, every line logged


def test_sync_never_writes_through_a_link_in_the_workdir_and_long_names_work(cluster, tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    shutil.copy(SCRIPT, src / "job.py")
    (src / "sub" / "model.py").write_text("W = 1\n")
    long_name = "n" * 255  # the filesystem's limit for one name
    (src / long_name).write_text("long\n")
    path, dests = sync_cluster(cluster, tmp_path, src)
    outside = tmp_path / "outside"
    outside.mkdir()
    dests[1].mkdir(parents=True)
    os.symlink(outside, dests[1] / "sub")  # a link where the copy needs a directory

    code, out, _ = ddp_up(str(path), "job.py", "env", "RANK")
    assert code == 3, out
    assert f"{dests[1] / 'sub'} is a symbolic link on this node, and sync never writes through one" in out, out
    assert os.listdir(outside) == [] and "ENV RANK" not in out

    os.unlink(dests[1] / "sub")
    code, out, _ = ddp_up(str(path), "job.py", "env", "RANK")
    assert code == 0, out
    for dest in dests:
        assert (dest / long_name).read_text() == "long\n" and (dest / "sub" / "model.py").is_file()
        assert not [n for n in os.listdir(dest) if n.startswith(".ddp-up-")]  # no temp file left
    assert yaml.safe_load(path.read_text())["sync"]["exclude"] == ["*.tmp"]
