"""Issue 3: no orphans, ever. Each fault ends with the right status, the node named, and zero
tagged processes on every node."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from tests.harness import procs
from tests.harness.runner import Launch, ddp_kill, run_dir
from tests.integration.conftest import SCRIPT

LONG_RUN = ["run", "--steps", "100000", "--step-time", "0.2"]
LONG_TICK = ["tick", "100000", "0.2"]  # the same pace without torch: where the launcher is not the subject


def start(path, *args: str) -> Launch:
    return Launch([str(path), SCRIPT, *args])


def training(launch: Launch, rank: int = 0, timeout: float = 90) -> str:
    launch.wait_line(rf"r{rank}\s+\| (step|tick) 1 rank={rank}", timeout)
    return launch.job_id


def assert_clean(job: str, timeout: float = 10) -> None:
    left = procs.wait_no_job_processes(job, timeout)
    assert not left, f"left behind: {left}"


def test_worker_sigkill_fails_fast_and_names_rank(cluster, cluster_file):
    """One of node 1's two ranks is killed: its peer there and node 0 stop, and it is named."""
    launch = start(cluster_file([(0, 1), (1, 2)]), *LONG_RUN)
    job = training(launch, rank=2)
    os.kill(procs.worker_pid(job, 2), signal.SIGKILL)
    assert launch.wait(60) == 1, launch.output
    node1 = re.escape(cluster.nodes[1].addr)
    assert re.search(rf"root cause: {node1} \(node 1, rank 2\): rank 2 was killed by SIGKILL", launch.output), \
        launch.output
    assert_clean(job)


def test_agent_sigkill_is_lost_and_swept(cluster, cluster_file):
    launch = start(cluster_file([(0, 1), (1, 1)]), *LONG_RUN)
    job = training(launch)
    os.kill(procs.agent_pid(job, 1), signal.SIGKILL)
    assert launch.wait(60) == 1, launch.output
    assert re.search(rf"root cause: {re.escape(cluster.nodes[1].addr)} \(node 1\): connection to the node agent lost",
                     launch.output), launch.output
    assert_clean(job)


def test_sshd_session_killed(cluster, cluster_file):
    # without torchrun: a lost agent's torchrun and ranks are swept in test_agent_sigkill_is_lost_and_swept
    launch = start(cluster_file([(0, 1), (1, 1)], launcher="none"), *LONG_TICK)
    job = training(launch)
    session = procs.parent_pid(procs.agent_pid(job, 1))
    assert "sshd" in open(f"/proc/{session}/cmdline").read()
    os.kill(session, signal.SIGKILL)
    assert launch.wait(60) == 1, launch.output
    assert f"{cluster.nodes[1].addr} (node 1): connection to the node agent lost" in launch.output, launch.output
    assert_clean(job)


def test_network_partition(cluster, cluster_file):
    launch = start(cluster_file([(0, 1), (1, 1)], orphan_timeout=4, stop_grace=2), *LONG_RUN)
    job = training(launch)
    cluster.partition(cluster.nodes[1])
    try:
        assert launch.wait(60) == 1, launch.output
        assert re.search(rf"root cause: {re.escape(cluster.nodes[1].addr)} \(node 1\): no heartbeat from the node",
                         launch.output), launch.output
        # The cut-off node cannot be reached: its agent's dead-man switch must stop the job there.
        assert_clean(job, timeout=4 + 2 + 10)
    finally:
        cluster.heal(cluster.nodes[1])


def test_controller_sigkill_leaves_nothing(cluster, cluster_file):
    path = cluster_file([(0, 2), (1, 2)], orphan_timeout=5)
    launch = start(path, *LONG_RUN)
    job = training(launch)
    launch.signal(signal.SIGKILL)
    launch.wait(10)
    assert_clean(job, timeout=5 + 10 + 5)
    # the agents kept the ranks' logs for the controller that vanished: ddp-kill's sweep removes them
    code, out = ddp_kill(str(path), "--job", job)
    assert code == 0 and "removed the state of" in out, out


def test_ctrl_c_while_connecting(cluster, cluster_file):
    """One node is unreachable (connect in progress) while the others are ready: Ctrl-C."""
    cluster.partition(cluster.nodes[2])
    try:
        launch = start(cluster_file([(0, 1), (1, 1), (2, 1)], ssh={"connect_timeout": 20}), *LONG_RUN)
        job = launch.job_id if procs.wait_for(lambda: "job " in launch.output, 30) else None
        assert procs.wait_for(lambda: procs.agent_pid(job, 0) and procs.agent_pid(job, 1), 30), launch.output
        launch.signal(signal.SIGINT)
        assert launch.wait(15) == 130, launch.output
        assert "READY" not in launch.output
        assert_clean(job)
    finally:
        cluster.heal(cluster.nodes[2])


def test_ctrl_c_during_rendezvous(cluster, cluster_file):
    path = cluster_file([(0, 1), (1, 1)])
    path.write_text(path.read_text().replace(f"- host: {cluster.nodes[1].addr}\n  gpus: 1",
                                             f"- host: {cluster.nodes[1].addr}\n  gpus: 1\n"
                                             f"  env: {{JOB_INIT_DELAY: 60}}"))
    launch = start(path, *LONG_RUN)
    assert procs.wait_for(lambda: "job " in launch.output, 30)
    job = launch.job_id
    assert procs.wait_for(lambda: procs.worker_pid(job, 0) and procs.worker_pid(job, 1), 60), launch.output
    launch.signal(signal.SIGINT)
    assert launch.wait(30) == 130, launch.output
    assert "READY" not in launch.output
    assert_clean(job)


def test_ctrl_c_during_training(cluster, cluster_file):
    launch = start(cluster_file([(0, 1), (1, 1), (2, 1), (3, 2)]), *LONG_RUN)
    job = training(launch)
    launch.signal(signal.SIGINT)
    assert launch.wait(30) == 130, launch.output
    assert "stopping all nodes" in launch.output
    assert re.search(r"│ 3\s+│ \S+\s+│ 3-4\s+│ stopped", launch.output), launch.output
    assert "root cause" not in launch.output  # an interrupt is not a failure
    assert_clean(job)


def test_double_ctrl_c_kills_now(cluster, cluster_file, tmp_path):
    """Workers save for minutes after a SIGTERM and stop_grace is long: only the second Ctrl-C ends it
    quickly."""
    path = cluster_file([(0, 1), (1, 1)], stop_grace=120, launcher="none", env={"OMP_NUM_THREADS": 1, "SAVE_S": "300"})
    launch = start(path, "save", str(tmp_path / "ckpt"))
    for rank in (0, 1):
        launch.wait_line(rf"r{rank}\s+\| rank {rank} SHUTDOWN_TIMEOUT=\S+ running", 90)
    job = launch.job_id
    launch.signal(signal.SIGINT)
    launch.wait_line("stopping all nodes", 10)
    launch.signal(signal.SIGINT)
    assert launch.wait(30) == 130, launch.output  # well under stop_grace
    assert "killing every job process now" in launch.output
    assert not list(tmp_path.glob("ckpt.*"))  # killed inside their save: none was let finish
    assert_clean(job)


def test_ddp_kill_stops_only_the_named_job(cluster, cluster_file):
    path = cluster_file([(0, 1), (1, 1)], launcher="none")  # the ranks' command lines are then the decoys' own
    decoy_cmd = [sys.executable, "-u", SCRIPT, *LONG_TICK]  # same script and command line, no tag
    decoys = [subprocess.Popen(decoy_cmd[:3] + ["decoy", "300"]) for _ in range(2)]
    decoys.append(subprocess.Popen(decoy_cmd, env={**os.environ, "JOB_DECOY": "1"}))
    a = b = None
    try:
        a, b = start(path, *LONG_TICK), start(path, *LONG_TICK)
        job_a, job_b = training(a), training(b)

        code, out = ddp_kill(str(path), "--job", job_a, "--dry-run")
        assert code == 0 and "dry run" in out and job_a in out, out
        assert procs.job_processes(job_a), "dry run must not stop anything"

        code, out = ddp_kill(str(path), "--job", job_a)
        assert code == 0, out
        assert a.wait(30) == 143, a.output  # as a SIGTERM to ddp-up: stopped, not failed
        assert "stopped by ddp-kill; stopping all nodes" in a.output, a.output
        assert not procs.job_processes(job_a)
        assert procs.job_processes(job_b) and b.proc.poll() is None, "the other job must keep running"
        assert all(d.poll() is None for d in decoys), "untagged processes must never be touched"

        code, out = ddp_kill(str(path))  # default: every job launched from this cluster file
        assert code == 0 and job_b in out, out
        assert b.wait(30) == 143
        assert all(d.poll() is None for d in decoys)
    finally:
        for launch in (a, b):
            if launch and launch.proc.poll() is None:
                launch.signal(signal.SIGINT)
                launch.wait(30)
        for d in decoys:
            d.kill()
            d.wait(5)


@pytest.mark.parametrize("stop_signal", ["SIGTERM", "SIGUSR1"])
def test_ctrl_c_gives_every_rank_its_whole_grace_once_and_prints_no_launcher_traceback(cluster, cluster_file,
                                                                                       tmp_path, stop_signal):
    """Issue 27, items 1 and 2: each rank gets the stop signal (`stop_signal:`) once and the whole
    stop_grace to save (torchrun's own wait is set to it: its default, 30 s, killed longer saves;
    and it passes on a SIGUSR1 it is told to handle); the launcher's report of a stop ddp-up asked
    for goes to the node's log file, not the console."""
    path = cluster_file([(0, 1), (1, 1)], stop_grace=20, stop_signal=stop_signal,
                        env={"OMP_NUM_THREADS": 1, "SAVE_S": "6", "SAVE_ON": stop_signal})
    launch = start(path, "save", str(tmp_path / "ckpt"))
    for rank in (0, 1):
        launch.wait_line(rf"r{rank}\s+\| rank {rank} SHUTDOWN_TIMEOUT=20 running", 90)
    launch.signal(signal.SIGINT)
    assert launch.wait(60) == 130, launch.output
    for rank in (0, 1):
        assert (tmp_path / f"ckpt.{rank}").read_text() == "saved\n"
        assert launch.output.count(f"rank {rank} got {stop_signal} #") == 1, launch.output
    assert "Traceback" not in launch.output and "SignalException" not in launch.output, launch.output
    node_log = (run_dir(launch.job_id) / f"node0-{cluster.nodes[0].addr}.log").read_text()
    assert "SignalException" in node_log  # torchrun's report of the stop: kept, not shown
    assert_clean(launch.job_id)


def launcher_keys(launcher: str) -> dict:
    """"torchrun", "none": the cold start (`warm: false`, under torchrun not the default); "warm",
    "warm-torchrun": `launcher: none` or torchrun with warm start (the ranks forked from the node's
    warm interpreter; under torchrun, its workers are stand-ins that pass signals on)."""
    if launcher.startswith("warm"):
        return {"launcher": launcher.partition("-")[2] or "none", "warm": True}
    return {"launcher": launcher, "warm": False}


@pytest.mark.parametrize("launcher", ["torchrun", "none", "warm", "warm-torchrun"])
def test_a_sigusr1_from_ddp_kill_or_to_ddp_up_reaches_every_rank_once_and_the_job_goes_on(cluster, cluster_file,
                                                                                           launcher):
    """Issue 27, item 3: `ddp-kill --signal USR1 --job ID` delivers it to every rank, straight
    (torchrun would take it for a stop), and stops nothing; so does ddp-up with a SIGUSR1 it gets (a
    Slurm warning, a user's kill; under `launcher: none` the ranks are the agent's own children).
    One run each launcher, both ways in turn: each rank gets each signal once."""
    path = cluster_file([(0, 2), (1, 1)], **launcher_keys(launcher))
    launch = start(path, "usr1")
    for rank in range(3):
        launch.wait_line(rf"r{rank}\s+\| rank {rank} running", 90)
    code, out = ddp_kill("--signal", "usr1", "--job", launch.job_id, str(path))
    assert code == 0, out
    assert "sent SIGUSR1 to 2 rank(s); nothing stopped" in out and "sent SIGUSR1 to 1 rank(s)" in out, out
    for rank in range(3):
        launch.wait_line(rf"r{rank}\s+\| rank {rank} got SIGUSR1 #1", 30)
    assert launch.proc.poll() is None and "got SIGUSR1 #2" not in launch.output  # it goes on, each got it once
    launch.signal(signal.SIGUSR1)
    for rank in range(3):
        launch.wait_line(rf"r{rank}\s+\| rank {rank} got SIGUSR1 #2", 30)
    assert "SIGUSR1: passed on to every rank of 2 running node(s)" in launch.output
    assert launch.proc.poll() is None and "got SIGUSR1 #3" not in launch.output
    launch.signal(signal.SIGINT)
    assert launch.wait(60) == 130, launch.output
    assert_clean(launch.job_id)


@pytest.mark.parametrize("launcher", ["torchrun", "none", "warm", "warm-torchrun"])
def test_a_save_that_overruns_stop_grace_is_killed_at_the_grace_and_named_in_the_summary(cluster, cluster_file,
                                                                                        tmp_path, launcher):
    """Issue 27, item 6: the grace is a limit too; what outlives it is killed (by torchrun, whose
    own wait is the grace, or by the agent) and the summary says so, node by node."""
    path = cluster_file([(0, 1), (1, 1)], stop_grace=2, **launcher_keys(launcher),
                        env={"OMP_NUM_THREADS": 1, "SAVE_S": "30"})
    launch = start(path, "save", str(tmp_path / "ckpt"))
    for rank in (0, 1):
        launch.wait_line(rf"r{rank}\s+\| rank {rank} SHUTDOWN_TIMEOUT=\S+ running", 90)
    launch.signal(signal.SIGINT)
    assert launch.wait(60) == 130, launch.output
    assert not list(tmp_path.glob("ckpt.*"))
    assert launch.output.count("1 process(es) killed at the end of stop_grace (2 s): a save took longer?") == 2, \
        launch.output
    nodes = json.loads((run_dir(launch.job_id) / "summary.json").read_text())["nodes"]
    assert all("killed at the end of stop_grace" in n["reason"] for n in nodes), nodes
    assert_clean(launch.job_id)


@pytest.mark.parametrize("stop", ["SIGTERM", "fail-fast", "hang"])
def test_every_stop_gives_the_ranks_their_grace_and_ends_with_the_right_status(cluster, cluster_file, tmp_path, stop):
    """Issue 27, item 6: the save-on-SIGTERM script, stopped by a SIGTERM to ddp-up (143), by
    fail-fast after another rank failed (1), or by the hang watch (1): every rank still running
    saves its checkpoint within the grace, once."""
    env = {"OMP_NUM_THREADS": 1, "SAVE_S": "3", **({"FAIL_RANK": "2"} if stop == "fail-fast" else {})}
    path = cluster_file([(0, 1), (1, 2)], stop_grace=15, env=env, launcher="none",  # torchrun's grace: tests above
                        **({"hang_timeout": 4} if stop == "hang" else {}))
    launch = start(path, "save", str(tmp_path / "ckpt"))
    for rank in range(3):
        launch.wait_line(rf"r{rank}\s+\| rank {rank} (SHUTDOWN_TIMEOUT=15 )?running", 90)
    if stop == "SIGTERM":
        launch.signal(signal.SIGTERM)
    code = launch.wait(90)
    assert code == (143 if stop == "SIGTERM" else 1), launch.output
    saving = (0, 1) if stop == "fail-fast" else (0, 1, 2)
    for rank in saving:
        assert (tmp_path / f"ckpt.{rank}").read_text() == "saved\n", launch.output
        assert launch.output.count(f"rank {rank} got SIGTERM #") == 1, launch.output
    if stop == "fail-fast":
        assert "root cause: " in launch.output and "rank 2 exited with code 7" in launch.output, launch.output
    if stop == "hang":
        assert "job hung" in launch.output or "looks hung" in launch.output, launch.output
    assert_clean(launch.job_id)
