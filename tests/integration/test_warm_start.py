"""Warm start (`warm: true`): each node's ranks are forked from an interpreter that imported torch
while the preflight ran, under ddp-up's own launcher and under torchrun (whose workers are then
stand-ins that ask for their rank). The same jobs as cold, on `transport: local` nodes (the agent,
relay and controller path of SSH at a fraction of the cost), and what held cold holds: the root
cause with the rank's exception, ddp-kill, Ctrl-C, nothing left behind."""

from __future__ import annotations

import json
import re
import signal
import sys
from pathlib import Path

import pytest

from tests.harness import procs, runner
from tests.harness.runner import ddp_kill, ddp_up, run_dir
from tests.integration.conftest import SCRIPT

LAUNCHERS = pytest.mark.parametrize("launcher", ["none", "torchrun"])


def warm_cluster(tmp_path, launcher="none", **keys):
    return runner.local_cluster(tmp_path, launcher=launcher, warm=True, **keys)


def job_of(out: str) -> str:
    return re.search(r"job (\d{8}-\d{6}-\w+)", out).group(1)


def ready_lines(out: str) -> list[str]:
    return re.findall(r"\| READY rank=\d+ world=\d+ .* warm=(\w+) attempt=", out, re.M)


@LAUNCHERS
def test_a_warm_job_runs_its_ranks_from_the_interpreter_that_imported_torch(tmp_path, launcher):
    path = warm_cluster(tmp_path, launcher, nodes=2, gpus=2)
    code, out, _ = ddp_up("--no-dashboard", str(path), SCRIPT, "run", "--steps", "2", timeout=180)
    assert code == 0, out
    assert ready_lines(out) == ["True"] * 4, out  # every rank found torch imported when its script began
    assert "warm start" not in out, out  # nothing to say: no notice, no fallback
    assert procs.wait_no_job_processes(job_of(out), 15) == []  # the interpreters too


def test_warm_false_is_today_s_cold_start(tmp_path):
    path = runner.local_cluster(tmp_path, nodes=1, gpus=2, launcher="none", warm=False)
    code, out, _ = ddp_up("--no-dashboard", str(path), SCRIPT, "run", "--steps", "1", timeout=180)
    assert code == 0, out
    assert ready_lines(out) == ["False"] * 2, out


@LAUNCHERS
def test_a_warm_rank_that_raises_is_the_root_cause_with_its_exception(tmp_path, launcher):
    path = warm_cluster(tmp_path, launcher, nodes=2, gpus=2)
    code, out, _ = ddp_up("--no-dashboard", str(path), SCRIPT, "run", "--raise-plain", "1", timeout=180)
    assert code == 1, out
    assert re.search(r"^root cause: local-0 \(node 0, rank 1\): rank 1 exited with code 1: RuntimeError: boom from "
                     r"rank 1$", out, re.M), out
    summary = json.loads((run_dir(job_of(out)) / "summary.json").read_text())
    assert summary["root_cause"]["traceback"][-1] == "RuntimeError: boom from rank 1"
    assert procs.wait_no_job_processes(job_of(out), 15) == []


def test_a_preload_that_fails_is_one_notice_and_the_job_still_runs_warm(tmp_path):
    path = warm_cluster(tmp_path, nodes=1, gpus=1, preload=["no_such_module_here"])
    code, out, _ = ddp_up("--no-dashboard", str(path), SCRIPT, "run", "--steps", "1", timeout=180)
    assert code == 0, out
    assert len(re.findall(r"warm start: preload no_such_module_here failed \(ModuleNotFoundError", out)) == 1, out
    assert ready_lines(out) == ["True"], out


@LAUNCHERS
def test_ddp_kill_stops_forked_ranks_and_their_interpreter_and_ps_names_each_rank(tmp_path, launcher):
    path = warm_cluster(tmp_path, launcher, nodes=1, gpus=2)
    launch = runner.Launch(["--no-dashboard", str(path), SCRIPT, "run", "--steps", "1000", "--step-time", "0.2"])
    try:
        launch.wait_line(r"READY rank=1 .* warm=True", 120)
        job = launch.job_id
        for rank in (0, 1):
            cmdline = Path(f"/proc/{procs.worker_pid(job, rank)}/cmdline").read_bytes().split(b"\0")
            assert cmdline[:3] == [sys.executable.encode(), b"-u", SCRIPT.encode()], cmdline
        code, out = ddp_kill(str(path), "--job", job)
        assert code == 0, out
        assert launch.wait(60) != 0, launch.output
    finally:
        if launch.proc.poll() is None:
            launch.signal(signal.SIGKILL)
            launch.wait(10)
    assert procs.wait_no_job_processes(job, 15) == []


@LAUNCHERS
def test_ctrl_c_ends_a_warm_job_and_leaves_nothing(tmp_path, launcher):
    path = warm_cluster(tmp_path, launcher, nodes=2, gpus=1)
    launch = runner.Launch(["--no-dashboard", str(path), SCRIPT, "run", "--steps", "1000", "--step-time", "0.2"])
    launch.wait_line(r"READY rank=1 .* warm=True", 120)
    launch.signal(signal.SIGINT)
    assert launch.wait(60) == 130, launch.output
    assert procs.wait_no_job_processes(launch.job_id, 15) == []


def test_an_attached_restart_runs_warm_too(tmp_path):
    """The next attempt's agents make their own warm interpreter (tagged with its attempt)."""
    path = warm_cluster(tmp_path, "torchrun", nodes=2, gpus=1, restarts=1, restart_delay=0)
    code, out, _ = ddp_up("--no-dashboard", str(path), SCRIPT, "run", "--fail-rank", "1", "--exit-code", "3",
                          "--fail-attempts", "0", timeout=240)
    assert code == 0, out
    assert re.findall(r"\| READY rank=\d world=2 .* warm=(\w+) attempt=1$", out, re.M) == ["True"] * 2, out
    assert procs.wait_no_job_processes(job_of(out), 15) == []
