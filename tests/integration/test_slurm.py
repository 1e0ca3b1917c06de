"""Issue 16: inside a Slurm allocation, the nodes are reached through srun, not SSH.

A real slurmctld and three slurmds (tests/harness/slurmcluster.py); the nodes run no sshd at all.
Skipped, with the reason, where Slurm is not installed.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness import procs
from tests.harness.exclusive import one_worker_at_a_time
from tests.harness.runner import CHECK, KILL, REPO, RUNS_ROOT, UP, Launch, _env, run_dir
from tests.harness.slurmcluster import SlurmCluster, available
from tests.integration.conftest import SCRIPT

pytestmark = pytest.mark.xdist_group("slurm")  # one worker's: one Slurm cluster (its network and ports are fixed)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    reason = available()
    if reason:
        pytest.skip(f"slurm: {reason}")
    with one_worker_at_a_time(tmp_path_factory, "slurm"):
        yield from _slurm_cluster(tmp_path_factory)


def _slurm_cluster(tmp_path_factory):
    cluster = SlurmCluster(3, tmp_path_factory.mktemp("slurm") / "cluster")
    try:
        try:
            cluster.up()
        except (AssertionError, OSError, subprocess.SubprocessError) as e:  # Slurm cannot run on this machine
            detail = getattr(e, "stderr", None) or str(e)
            pytest.skip(f"slurm: the test cluster did not start: {detail}"[:600])
        yield cluster
    finally:
        cluster.down()


@pytest.fixture
def slurm_file(tmp_path):
    def make(**top) -> str:
        import yaml

        doc = {"python": sys.executable, "workdir": str(tmp_path), "env": {"OMP_NUM_THREADS": 1},
               "orphan_timeout": 10, "stop_grace": 3, "report": False, **top}  # its page: the report's tests
        path = tmp_path / "cluster.yaml"
        path.write_text(yaml.safe_dump(doc))
        return str(path)
    return make


def in_allocation(cluster: SlurmCluster, *args: str, code: str = UP) -> Launch:
    """`salloc -N3 ddp-up --slurm ...` (or ddp-check, ddp-kill), in a session of its own."""
    ours = ["--no-dashboard"] if code == UP else []
    return Launch(["--slurm", *ours, *args], code=code, env={"SLURM_CONF": cluster.env["SLURM_CONF"]},
                  prefix=("salloc", "-N3", "--ntasks-per-node=1", "--quiet"))


def command_pid(run: Launch) -> int:
    """ddp-up's pid: salloc's child (salloc puts it in a process group of its own, and gives it the
    terminal, so a Ctrl-C there reaches ddp-up, not salloc)."""
    children = Path(f"/proc/{run.proc.pid}/task/{run.proc.pid}/children").read_text().split()
    assert children, run.output
    return int(children[0])


def test_three_nodes_without_sshd_run_a_torchrun_job_over_srun(slurm, slurm_file):
    run = in_allocation(slurm, slurm_file(), SCRIPT, "run", "--steps", "2")
    assert run.wait(120) == 0, run.output
    out = run.output
    assert "master dsl1:" in out, out  # the first node's name, resolved by the nodes only
    for rank, node in ((0, "dsl1"), (1, "dsl2"), (2, "dsl3")):
        assert re.search(rf"^{node}\s+r{rank}\s+\| READY rank={rank} world=3 host={node}", out, re.M), out
    assert re.findall(r"\| READY rank=\d+ .* warm=(\w+) attempt=", out) == ["True"] * 3, out  # warm, the default
    assert not procs.wait_no_job_processes(None, 15)


def test_a_failing_rank_is_named_with_its_node_and_every_node_stops(slurm, slurm_file):
    run = in_allocation(slurm, slurm_file(), SCRIPT, "run", "--steps", "100", "--step-time", "0.2",
                       "--fail-rank", "2", "--exit-code", "7")
    assert run.wait(120) == 1, run.output
    assert re.search(r"root cause: dsl3 \(node 2, rank 2\): rank 2 exited with code 7", run.output), run.output
    assert not procs.wait_no_job_processes(None, 15)


def test_ctrl_c_in_the_allocation_stops_every_node(slurm, slurm_file):
    run = in_allocation(slurm, slurm_file(launcher="none"), SCRIPT, "tick", "3000", "0.1")
    run.wait_line(r"^dsl3\s+r2\s+\| tick \d+ rank=2", 60)
    os.killpg(command_pid(run), signal.SIGINT)  # a Ctrl-C at the terminal salloc gave ddp-up
    assert run.wait(60) == 130, run.output
    assert "SIGINT: stopping all nodes" in run.output, run.output
    assert not procs.wait_no_job_processes(None, 15)


def test_a_node_lost_inside_the_allocation_is_left_out_and_taken_back_when_it_answers(slurm, slurm_file):
    """`min_nodes: 2` inside a 3-node allocation: dsl3's step ends abruptly (its srun killed, as
    when the node dies), the node is lost, and the next attempt runs within the allocation on the
    two left, naming the lost node as Slurm names it. The node itself is well: asked through a
    step of its own, it answers, and after `rejoin_after` the run grows back to all three, which
    run the job to its end."""
    run = in_allocation(slurm, slurm_file(launcher="none", min_nodes=2, rejoin_after=2, restart_delay=0,
                                          orphan_timeout=3), SCRIPT, "tick", "60", "0.1")
    run.wait_line(r"^dsl3\s+r2\s+\| tick 3 rank=2", 60)
    step = subprocess.run(["pgrep", "-f", f"srun .*--nodelist=dsl3 .*DDP_UP_JOB={run.job_id}"], capture_output=True,
                          text=True).stdout.split()
    assert step, run.output
    os.kill(int(step[0]), signal.SIGKILL)
    assert run.wait(120) == 0, run.output
    out = run.output
    assert "dsl3 is out until it answers again (lost); no spare left: going on with 2 node(s)" in out, out
    assert "attempt 1: 2 node(s) (dsl1, dsl2), world size 2; out of the run: dsl3" in out, out
    assert re.search(r"attempt 2: 3 node\(s\) \(dsl1, dsl2, dsl3\), world size 3", out), out
    assert re.search(r"^dsl3\s+r2\s+\| tick 59 rank=2", out, re.M), out
    assert not procs.wait_no_job_processes(None, 15)


def test_scancel_of_the_allocation_is_named_as_slurm_s_doing(slurm, slurm_file):
    run = in_allocation(slurm, slurm_file(launcher="none"), SCRIPT, "tick", "3000", "0.1")
    run.wait_line(r"^dsl3\s+r2\s+\| tick \d+ rank=2", 60)
    jobs = subprocess.run(["squeue", "-h", "-o", "%i"], env=slurm.env, capture_output=True, text=True, timeout=30)
    assert jobs.stdout.split(), jobs
    subprocess.run(["scancel", *jobs.stdout.split()], env=slurm.env, check=True, timeout=30)
    code = run.wait(60)
    assert code != 0, run.output
    assert "Slurm cancelled" in run.output, run.output
    assert "connection to the node agent lost" not in run.output, run.output
    assert not procs.wait_no_job_processes(None, 15)


def test_ddp_check_and_ddp_kill_reach_the_nodes_through_steps_too(slurm, slurm_file, tmp_path):
    path = slurm_file(launcher="none")
    check = in_allocation(slurm, path, code=CHECK)
    assert check.wait(60) == 0, check.output
    for node in ("dsl1", "dsl2", "dsl3"):
        assert re.search(rf"│ \d+\s+│ {node}\s+│ ✓", check.output), check.output
    # In one allocation: a job runs, and ddp-kill --slurm, from the same allocation, stops it.
    up = shlex.join([sys.executable, "-c", UP, "--slurm", "--no-dashboard", "--runs-dir", RUNS_ROOT, path, SCRIPT,
                     "tick", "3000", "0.1"])
    kill = shlex.join([sys.executable, "-c", KILL, "--slurm", path])  # its jobs: not --all, a parallel worker's too
    out = tmp_path / "up.out"
    script = (f"{up} >{out} 2>&1 & job=$!\n"
              f"for i in $(seq 600); do grep -q 'tick 3 rank=2' {out} && break; sleep 0.1; done\n"
              f"{kill}; echo \"kill=$?\"\nwait $job; echo \"up=$?\"\n")
    env = {**_env(), "SLURM_CONF": slurm.env["SLURM_CONF"]}
    done = subprocess.run(["salloc", "-N3", "--ntasks-per-node=1", "--quiet", "bash", "-c", script], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    report = done.stdout + out.read_text()
    # Every node's sweep answered through its step. Each sweeps its own node's part of the job (not
    # --all: these namespace nodes share one process table with a parallel test worker's jobs), and
    # the first one's stop ends the job everywhere, so later sweeps may find its parts gone.
    found = [int(n) for n in re.findall(r"│ \d\s+│ dsl\d\s+│ \S+\s+│ (\d+)\s+│ \d+\s+│ \d+\s+│ 0\s+│\s+│", done.stdout)]
    assert "kill=0" in done.stdout and len(found) == 3 and sum(found) >= 2, report  # an agent and its worker at least
    assert "up=143" in done.stdout and "stopped by ddp-kill" in report, report
    assert not procs.wait_no_job_processes(None, 15)


def test_detach_through_srun_is_refused_before_anything_starts(slurm, slurm_file):
    run = in_allocation(slurm, "--detach", slurm_file(launcher="none"), SCRIPT, "tick", "1", "0")
    assert run.wait(60) == 2, run.output
    assert "--detach: a job reached through srun ends with its allocation" in run.output, run.output


def test_sbatch_submits_a_batch_job_that_runs_the_job_with_slurm(slurm, tmp_path):
    settings = tmp_path / "settings.yaml"
    settings.write_text(f"python: {sys.executable}\nworkdir: {tmp_path}\nlauncher: none\n")
    env = {**_env(), "SLURM_CONF": slurm.env["SLURM_CONF"]}
    runs = tmp_path / "runs"
    done = subprocess.run([sys.executable, "-c", UP, "--runs-dir", str(runs), "--sbatch", "-N3", "--ntasks-per-node=1",
                           str(settings), SCRIPT, "tick", "3", "0"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    m = re.search(r"submitted Slurm job (\d+) .* runs ddp-up job (\S+) with --slurm", done.stdout)
    assert m, done.stdout
    slurm_job, job = m.groups()
    deadline = time.monotonic() + 90
    while subprocess.run(["squeue", "-h", "-j", slurm_job], env=slurm.env, capture_output=True, text=True,
                         timeout=30).stdout.strip():
        assert time.monotonic() < deadline, (tmp_path / f"slurm-{slurm_job}.out").read_text()
        time.sleep(0.2)
    out = (tmp_path / f"slurm-{slurm_job}.out").read_text()
    assert re.search(r"^dsl3\s+r2\s+\| tick 2 rank=2$", out, re.M), out
    summary = json.loads((runs / job / "summary.json").read_text())
    assert summary["exit_code"] == 0, summary


def test_slurms_warning_reaches_every_rank_once_and_its_time_limit_stops_them_with_their_grace(slurm, slurm_file,
                                                                                                tmp_path):
    """Issue 27, item 4: `salloc --time=0:20` (20 s: slurmctld acts on it at its next pass, within
    30 s), and the warning `--signal=USR1@T` would send. The
    warning goes to every process of each step: every rank gets it once, and the job goes on (the
    agents and torchrun ignore it); at the time limit Slurm's SIGTERM starts the graceful stop,
    every rank saves within KillWait, and the end is named as Slurm's doing, a stop from outside
    the job. The warning is sent as Slurm sends it (to every step: scancel --signal), not waited
    for: slurmctld checks for it only at its periodic pass, which can fall after the time limit's
    (then no warning comes at all)."""
    ckpt = tmp_path / "ckpt"
    # KillWait is 10 s in the test cluster: the grace and the save fit in it, as they must (README)
    path = slurm_file(stop_grace=5, restarts=2, env={"OMP_NUM_THREADS": 1, "SAVE_S": "1"})
    run = Launch(["--slurm", "--no-dashboard", path, SCRIPT, "save", str(ckpt)], code=UP,
                 env={"SLURM_CONF": slurm.env["SLURM_CONF"]},
                 prefix=("salloc", "-N3", "--ntasks-per-node=1", "--quiet", "--time=0:20"))
    for rank in range(3):
        run.wait_line(rf"r{rank}\s+\| rank {rank} SHUTDOWN_TIMEOUT=\S+ running", 50)
    job = subprocess.run(["squeue", "-h", "-o", "%i"], env=slurm.env, capture_output=True, text=True,
                         timeout=30).stdout.split()
    assert len(job) == 1, job  # this test's allocation: the Slurm tests take one worker at a time
    subprocess.run(["scancel", "--signal=USR1", job[0]], env=slurm.env, check=True, timeout=30)
    for rank in range(3):
        run.wait_line(rf"r{rank}\s+\| rank {rank} got SIGUSR1 #1", 30)
    code = run.wait(150)
    out = run.output
    assert code == 1, out
    for rank in range(3):
        assert out.count(f"rank {rank} got SIGUSR1 #") == 1, out
        assert (tmp_path / f"ckpt.{rank}").exists() and (tmp_path / f"ckpt.{rank}").read_text() == "saved\n", out
    assert re.search(r"root cause: dsl\d \(node \d\): Slurm cancelled step \S+ due to time limit", out), out
    attempts = json.loads((run_dir(run.job_id) / "summary.json").read_text())["attempts"]
    assert [(a["end"], a["next"]) for a in attempts] == [
        ("stopped from outside", "Slurm is ending the allocation: no new attempt in it (sbatch --requeue has Slurm "
                                 "start the job again)")], attempts
    assert not procs.wait_no_job_processes(None, 15)


def test_sbatch_passes_a_b_signal_to_ddp_up_which_passes_it_to_every_rank_once(slurm, tmp_path):
    """Issue 27, item 4: `--signal=B:USR1@T` goes to the batch shell only, which is ddp-up (the
    batch script execs it): ddp-up passes it on to every rank once, and the job goes on. Sent here
    as Slurm sends it, to the batch step (scancel --batch), without waiting for a time limit."""
    settings = tmp_path / "settings.yaml"
    settings.write_text(f"python: {sys.executable}\nworkdir: {tmp_path}\nlauncher: none\nstop_grace: 1\n")
    env = {**_env(), "SLURM_CONF": slurm.env["SLURM_CONF"]}
    runs = tmp_path / "runs"
    done = subprocess.run([sys.executable, "-c", UP, "--runs-dir", str(runs), "--sbatch", "-N3", "--ntasks-per-node=1",
                           str(settings), SCRIPT, "usr1"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    slurm_job = re.search(r"submitted Slurm job (\d+)", done.stdout).group(1)
    log = tmp_path / f"slurm-{slurm_job}.out"
    try:
        assert procs.wait_for(lambda: log.exists() and log.read_text().count(" running\n") >= 3, 90), \
            log.exists() and log.read_text()
        subprocess.run(["scancel", "--batch", "--signal=USR1", slurm_job], env=slurm.env, check=True, timeout=30)
        assert procs.wait_for(lambda: log.read_text().count("got SIGUSR1 #1") >= 3, 30), log.read_text()
        out = log.read_text()
        assert "SIGUSR1: passed on to every rank of 3 running node(s)" in out, out
        assert "got SIGUSR1 #2" not in out and subprocess.run(  # each rank got it once, and the job goes on
            ["squeue", "-h", "-j", slurm_job], env=slurm.env, capture_output=True, text=True, timeout=30).stdout.strip()
    finally:
        subprocess.run(["scancel", slurm_job], env=slurm.env, timeout=30)
        procs.wait_for(lambda: not subprocess.run(["squeue", "-h", "-j", slurm_job], env=slurm.env, capture_output=True,
                                                  text=True, timeout=30).stdout.strip(), 60)
    assert not procs.wait_no_job_processes(None, 15)
