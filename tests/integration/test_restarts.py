"""Issue 18: restarts and spare nodes on the sshd cluster. A restart is ddp-up's decision, whatever
the launcher: the first test restarts real torchrun jobs, the others start their ranks without
torchrun (`launcher: none`, see conftest.cluster_file)."""

from __future__ import annotations

import csv
import json
import os
import re
import signal
from pathlib import Path

import pytest

from tests.harness import procs
from tests.harness.runner import Launch, ddp_kill, ddp_up, run_dir
from tests.integration.conftest import SCRIPT

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

LAUNCHER = "none"  # but where a test names torchrun (see conftest.cluster_file)
SAYS_WORLD = {"OMP_NUM_THREADS": 1, "TICK_SAYS_WORLD": 1}  # the torch-free tick says each rank's world and attempt


def summary(out: str) -> dict:
    job = re.search(r"job (\d{8}-\d{6}-\w+)", out).group(1)
    return json.loads((run_dir(job) / "summary.json").read_text())


@pytest.mark.long
def test_a_rank_failing_in_two_attempts_is_restarted_and_the_third_succeeds(cluster, cluster_file):
    path = cluster_file([(0, 1), (1, 1)], restarts=2, restart_delay=0.5, launcher="torchrun")
    code, out, _ = ddp_up(str(path), SCRIPT, "run", "--fail-rank", "1", "--exit-code", "7",
                          "--fail-attempts", "0,1", timeout=240)
    assert code == 0, out
    attempts = summary(out)["attempts"]
    assert [a["attempt"] for a in attempts] == [0, 1, 2]
    assert [a["root_cause"] for a in attempts] == [f"{cluster.nodes[1].addr} (node 1, rank 1): rank 1 exited with "
                                                   "code 7"] * 2 + [None]
    assert [a["exit_code"] for a in attempts] == [1, 1, 0] and all(a["world_size"] == 2 for a in attempts)
    assert len(re.findall(r"READY rank=\d world=2 .* attempt=2$", out, re.M)) == 2, out
    assert "attempt 1 (restart 1 of 2) in 0.5 s" in out and "attempt 2 (restart 2 of 2) in 1 s" in out, out
    assert [(a["end"], a["next"]) for a in attempts] == [("failed", "restart 1 of 2"), ("failed", "restart 2 of 2"),
                                                         ("succeeded", None)]
    assert re.search(r"job \S+ ok after [\d.]+ s in 3 attempts \(exit status 0\)", out), out


def test_when_restarts_run_out_the_run_fails_with_no_further_attempt(cluster, cluster_file):
    path = cluster_file([(0, 1), (1, 1)], restarts=1, restart_delay=0.2, env=SAYS_WORLD)
    code, out, _ = ddp_up(str(path), SCRIPT, "tick", "20", "0.1", "0", "5", timeout=240)  # rank 0 exits 5, each attempt
    assert code == 1, out
    attempts = summary(out)["attempts"]
    assert [a["attempt"] for a in attempts] == [0, 1] and attempts[-1]["next"] == "no restart left (restarts: 1)"
    assert "attempt=2" not in out and "(restart 1 of 1) in" in out and "attempt 1 failed: no restart left" in out
    for n in (0, 1):  # each attempt's root cause, named in the final summary
        assert f"attempt {n} (2 node(s), world size 2): {cluster.nodes[0].addr} (node 0, rank 0): rank 0 exited with code 5" in out, out


def test_a_node_cut_off_mid_run_is_replaced_by_the_spare_and_the_job_resumes(cluster, cluster_file, tmp_path):
    lost, spare = cluster.nodes[1], cluster.nodes[2]
    path = cluster_file([(0, 1), (1, 1), (2, 1)], spares=1, restarts=1, restart_delay=0.5, orphan_timeout=3,
                        warm=True, env={"OMP_NUM_THREADS": 1, "THIS_TEST": str(tmp_path)})
    checkpoint = tmp_path / "ckpt"
    # long enough that the job is still running once the spare's interpreter is ready, however slow
    launch = Launch([str(path), SCRIPT, "run", "--steps", "60", "--step-time", "0.2", "--checkpoint", str(checkpoint)])
    try:
        launch.wait_line(r"step 4 rank=1$", 120)
        ours = lambda: kept_interpreters(str(tmp_path))  # noqa: E731
        kept = procs.wait_for(lambda: len(ours()) >= 3 and ours(), 60)  # the spare's too
        assert kept and "step 59 rank=0" not in launch.output, launch.output
        cluster.partition(lost)
        code = launch.wait(240)
    finally:
        cluster.heal(lost)
        launch.proc.kill()
    out = launch.output
    assert code == 0, out
    assert "disabling multiplexing" not in out, out  # the kept interpreters' ssh never raced the agents' for the master
    assert f"{lost.addr} is out until it answers again (lost); spare {spare.addr} takes its place as node 1" in out
    ready = re.search(rf"^{re.escape(spare.addr)}\s+r1\s+\| READY rank=1 world=2 host={spare.name} .* ppid=(\d+) "
                      r"warm=True attempt=1$", out, re.M)
    assert ready, out
    assert int(ready.group(1)) in kept, (ready.group(0), kept)  # forked from the interpreter it kept ready before
    resumed = int(re.search(r"resumed at step (\d+) rank=0", out).group(1))
    assert resumed >= 5 and "step 59 rank=1" in out, out
    attempts = summary(out)["attempts"]
    assert [a["nodes"] for a in attempts] == [[n.addr for n in cluster.nodes[:2]], [cluster.nodes[0].addr, spare.addr]]
    assert attempts[0]["root_cause"].startswith(f"{lost.addr} (node 1)") and attempts[1]["root_cause"] is None
    # issue 27, item 5: a lost node is not the job's own failure: `restarts:` stays untouched
    assert attempts[0]["end"] == "lost" and attempts[0]["next"].startswith("recovery 1 of 3 (not the job's own"), attempts
    # the cut-off node stops its part by itself: the leak check after this test waits for that


def losses_of(kept: Path, attempt: str) -> set[str]:
    """The ranks whose loss of ``attempt`` metrics.csv holds so far."""
    if not kept.exists():
        return set()
    with open(kept, newline="") as f:
        return {r["rank"] for r in csv.DictReader(f) if r.get("attempt") == attempt and r.get("name") == "loss"}


@pytest.mark.long
def test_the_ddp_example_resumes_from_its_checkpoint_smaller_then_at_the_full_size_again(cluster, cluster_file):
    """examples/train.py --checkpoint under torchrun, warm, at 3 nodes, `min_nodes: 2` and no
    spare: node 2 cut off is out of the run, which goes on at 2 nodes with the example resuming
    after its last saved step at world size 2; the link back, node 2 answers for `rejoin_after:`,
    the smaller attempt is stopped with its grace, and the next one runs on every listed node
    again, the example resuming at world size 3. Ctrl-C then ends it."""
    back = cluster.nodes[2]
    path = cluster_file([(0, 1), (1, 1), (2, 1)], launcher="torchrun", min_nodes=2, rejoin_after=1,
                        restart_delay=0.2, orphan_timeout=3, stop_grace=3, metrics=True)
    launch = Launch([str(path), str(EXAMPLES / "train.py"), "--steps", "100000", "--step-time", "0.2",
                     "--checkpoint", "ckpt.pt", "--global-batch", "6"])
    try:
        launch.wait_line(r"r0 \| step 3 loss", 180)
        cluster.partition(back)
        launch.wait_line(r"resumed after step \d+ at world size 2$", 180)
        cluster.heal(back)
        launch.wait_line(r"resumed after step \d+ at world size 3$", 180)
        kept = run_dir(launch.job_id) / "metrics.csv"  # written as the run goes: each rank's loss of attempt 2 kept
        assert procs.wait_for(lambda: {"0", "2"} <= losses_of(kept, attempt="2"), 60, interval=0.5), launch.output
        launch.signal(signal.SIGINT)
        code = launch.wait(60)
    finally:
        cluster.heal(back)
        launch.proc.kill()
    out = launch.output
    assert code == 130, out
    smaller, grown = (int(re.search(rf"resumed after step (\d+) at world size {w}$", out, re.M).group(1)) for w in (2, 3))
    assert 3 <= smaller < grown, out  # each resumed from the last step saved, none lost, none twice
    assert f"{back.addr} is out until it answers again (lost); no spare left: going on with 2 node(s)" in out, out
    assert f"{back.addr} answer(s) again: stopping all nodes with their grace" in out, out
    assert f"{back.addr} answers again: it rejoins the run, which grows back to 3 node(s)" in out, out
    attempts = summary(out)["attempts"]
    assert [a["nodes"] for a in attempts] == [[n.addr for n in cluster.nodes[:3]], [n.addr for n in cluster.nodes[:2]],
                                              [n.addr for n in cluster.nodes[:3]]], attempts
    assert [(a["end"], a["world_size"]) for a in attempts] == [("lost", 3), ("stopped to grow", 2), ("stopped", 3)]
    assert attempts[1]["next"] == f"grown back to 3 node(s): {back.addr} rejoined", attempts
    assert [a["out"] for a in attempts] == [[], [back.addr], []], attempts
    # its curve goes on across the shrink and the grow: each attempt's steps start where the
    # checkpoint was, as the example prints them, and rank 0's loss is kept in every attempt
    job = re.search(r"job (\d{8}-\d{6}-\w+)", out).group(1)
    with open(run_dir(job) / "metrics.csv", newline="") as f:
        rank0 = [(int(r["attempt"]), float(r["step"])) for r in csv.DictReader(f) if r["rank"] == "0" and r["name"] == "loss"]
    first = {a: min(step for at, step in rank0 if at == a) for a in (0, 1, 2)}
    assert first == {0: 0.0, 1: smaller + 1, 2: grown + 1}, (first, smaller, grown)


def test_ctrl_c_while_waiting_to_restart_stops_for_good(cluster, cluster_file):
    path = cluster_file([(0, 1), (1, 1)], restarts=3, restart_delay=60, env=SAYS_WORLD)
    launch = Launch([str(path), SCRIPT, "tick", "20", "0.1", "1", "3"])
    try:
        launch.wait_line(r"attempt 1 \(restart 1 of 3\) in 60 s", 120)
        launch.signal(signal.SIGINT)
        code = launch.wait(15)
    finally:
        launch.proc.kill()
    out = launch.output
    assert code == 130, out
    assert "SIGINT while waiting to restart: no new attempt" in out and "attempt=1" not in out
    attempts = summary(out)["attempts"]
    assert [(a["attempt"], a["next"]) for a in attempts] == [(0, "SIGINT while waiting to restart: no new attempt")]


def test_an_exit_code_in_no_restart_on_exit_runs_once(cluster, cluster_file):
    """Issue 27, item 5: restarts: 3, and the rank exits with a code a restart cannot fix."""
    path = cluster_file([(0, 1), (1, 1)], restarts=3, restart_delay=0.2, no_restart_on_exit=[3], env=SAYS_WORLD)
    code, out, _ = ddp_up(str(path), SCRIPT, "tick", "20", "0.1", "1", "3", timeout=240)
    assert code == 1, out
    assert f"{cluster.nodes[1].addr} rank 1 exited with 3, which no_restart_on_exit lists: no restart" in out, out
    assert "attempt 1" not in out and "WORLD 2 rank=1 attempt=0" in out


def test_a_node_stopped_from_outside_is_recovered_and_restarts_stay_untouched(cluster, cluster_file):
    """Issue 27, item 5: a signal to a node's agent that ddp-up did not send (Slurm's preemption,
    a shutdown) is not one of the job's failures: `restarts: 0`, and the run recovers."""
    path = cluster_file([(0, 1), (1, 1)], restarts=0, recoveries=1, restart_delay=0.2, launcher="none")
    launch = Launch([str(path), SCRIPT, "tick", "30", "0.1"])
    try:
        launch.wait_line(r"r1\s+\| tick 3 rank=1$", 90)
        os.kill(procs.agent_pid(launch.job_id, 1), signal.SIGTERM)
        code = launch.wait(120)
    finally:
        launch.proc.kill()
    out = launch.output
    assert code == 0, out
    attempts = summary(out)["attempts"]
    assert [(a["attempt"], a["end"]) for a in attempts] == [(0, "stopped from outside"), (1, "succeeded")], attempts
    assert attempts[0]["root_cause"] == f"{cluster.nodes[1].addr} (node 1): stopped on the node: agent got SIGTERM"
    assert attempts[0]["next"] == "recovery 1 of 1 (not the job's own failure: restarts: untouched)", attempts
    assert "tick 29 rank=1" in out, out


def test_ddp_kill_of_a_run_with_restarts_left_saves_every_checkpoint_and_ends_it(cluster, cluster_file, tmp_path):
    """Issue 27, items 1, 5 and 6: ddp-kill gives every rank its grace to save, and the run is
    over (ddp-kill's stop is no failure to restart after): exit status 143, one attempt."""
    path = cluster_file([(0, 1), (1, 1)], restarts=2, stop_grace=20,
                        env={"OMP_NUM_THREADS": 1, "SAVE_S": "4"})
    launch = Launch([str(path), SCRIPT, "save", str(tmp_path / "ckpt")])
    try:
        for rank in (0, 1):
            launch.wait_line(rf"r{rank}\s+\| rank {rank} SHUTDOWN_TIMEOUT=20 running", 90)
        code, kill_out = ddp_kill("--job", launch.job_id, str(path))
        assert code == 0, kill_out
        code = launch.wait(60)
    finally:
        launch.proc.kill()
    out = launch.output
    assert code == 143, out
    for rank in (0, 1):
        assert (tmp_path / f"ckpt.{rank}").read_text() == "saved\n"
        assert out.count(f"rank {rank} got SIGTERM #") == 1, out
    assert "stopped by ddp-kill; stopping all nodes" in out, out
    attempts = summary(out)["attempts"]
    assert [(a["attempt"], a["end"], a["next"]) for a in attempts] == [(0, "stopped", None)], attempts


def kept_interpreters(test: str) -> set[int]:
    """The warm interpreters kept across attempts (node/attempt/keep.py) running now for this test. They
    belong to no job (no job's cleanup may end them), so another test worker's are told apart by
    the cluster file's `env:`, which they carry."""
    def ours(pid: int) -> bool:
        env = procs.environ(pid)
        return "DDP_UP_KEEP" in env and env.get("THIS_TEST") == test

    def warm(pid: int) -> bool:
        try:
            return b"'ddp_up_warm';" in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return False

    return {pid for pid in procs.all_pids() if ours(pid) and warm(pid)}
