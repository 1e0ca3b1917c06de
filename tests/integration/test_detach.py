"""Issue 15: a detached job outlives ddp-up; ddp-attach, ddp-logs, ddp-ls and ddp-kill --job.

On the sshd cluster, with `launcher: none` and the torch-free `tick` workload (a detached job's
supervision is the agents' own, whatever the launcher), except one torchrun job.
"""

from __future__ import annotations

import contextlib
import json
import re
from datetime import datetime
import signal
import time

import pytest
import yaml

from tests.harness import procs
from tests.harness.runner import RUNS_ROOT, Launch, ddp_kill, ddp_up, run_dir
from tests.integration.conftest import SCRIPT

ATTACH = "from orchestrator.commands.entry import attach; attach()"
LOGS = "from orchestrator.commands.entry import logs; logs()"
LS = "from orchestrator.commands.entry import ls; ls()"
REPORT = "from orchestrator.commands.entry import report; report()"
ORPHAN = 3.0  # the cluster files' orphan_timeout: the controller is gone for many times this


@pytest.fixture
def detached(cluster_file):
    """A cluster file for detached jobs, and their records purged from the nodes at the end."""
    made = []

    def make(layout, **top):
        top.setdefault("launcher", "none")
        top.setdefault("stop_grace", 3)
        path = cluster_file(layout, orphan_timeout=ORPHAN, **top)
        made.append(path)
        return path

    yield make
    for path in made:
        code, out = ddp_kill(str(path), "--purge")  # its own jobs (--all: a parallel test worker's too)
        assert code == 0, out


def run(code: str, *args: str, timeout: float = 60) -> tuple[int, str]:
    launch = Launch(list(args), code=code)
    return launch.wait(timeout), launch.output


def jobs(path, reachable: bool | None = True) -> dict[str, dict]:
    """ddp-ls's rows by job; ``reachable``: every node answers (exit 0), some do not (3), or either (None)."""
    code, out = run(LS, str(path), "--json")
    assert code in ((0, 3) if reachable is None else (0,) if reachable else (3,)), out
    return {row["job"]: row for row in map(json.loads, (line for line in out.splitlines() if line.startswith("{")))}


def await_row(path, job: str, ready, within: float = 60, reachable: bool | None = False) -> dict:
    """ddp-ls's row of ``job``, asked until ``ready(row)`` (some nodes cut off: ddp-ls exits 3)."""
    deadline = time.monotonic() + within
    while True:
        row = jobs(path, reachable=reachable).get(job, {})
        if ready(row):
            return row
        assert time.monotonic() < deadline, row
        time.sleep(1.0)  # each ask is a ddp-ls: a controller and an ssh a node (0.3-0.4 s of CPU)


def cut_until(cluster, nodes, path, job: str, ready, then=lambda: None) -> dict:
    """Cut ``nodes``' links, do ``then``, and heal them once ddp-ls's row of ``job`` is ``ready``: that row."""
    for node in nodes:
        cluster.partition(node)
    try:
        then()
        return await_row(path, job, ready)
    finally:
        for node in nodes:
            cluster.heal(node)


def cut_until_shown(cluster, node, follow: Launch, pattern: str, within: float = 60) -> str:
    """Cut ``node``'s link, and heal it once the live attach ``follow`` shows a line matching ``pattern``."""
    cluster.partition(node)
    try:
        return follow.wait_line(pattern, within)
    finally:
        cluster.heal(node)


@contextlib.contextmanager
def attached(path, job: str):
    """A live ddp-attach following ``job``, killed at the end whatever happened."""
    follow = Launch([str(path), job, "--no-dashboard", "--runs-dir", RUNS_ROOT], code=ATTACH)
    try:
        yield follow
    finally:
        follow.proc.kill()


def worlds_of(out: str) -> dict[tuple[int, int], int]:
    """{(attempt, rank): world size} as job.py tick's ranks said (TICK_SAYS_WORLD)."""
    return {(int(a), int(r)): int(w) for w, r, a in re.findall(r"r\d+ \| WORLD (\d+) rank=(\d+) attempt=(\d+)$", out, re.M)}


def attempts_of(job: str) -> list[dict]:
    return json.loads((run_dir(job) / "summary.json").read_text())["attempts"]


ENDS = {"done", "failed", "stopped", "lost"}  # the states a job's end leaves (ddp-ls)


def wait_state(path, job: str, states: tuple[str, ...], timeout: float) -> dict:
    """The job's ddp-ls row once its state is one of ``states``; bounded. Its end is awaited with
    ddp-attach, which follows the job until then: each ddp-ls is a controller and an ssh per node
    (0.3-0.4 s of CPU), and polling one every half second for a minute cost a test 12 s of CPU. A
    state on the way (restarting) is polled for."""
    deadline = time.monotonic() + timeout
    if ENDS.issuperset(states):
        run(ATTACH, str(path), job, "--no-dashboard", "--runs-dir", RUNS_ROOT, timeout=timeout)
    while True:
        row = jobs(path).get(job)
        if row and row["state"] in states:
            return row
        assert time.monotonic() < deadline, f"job {job} not {states} within {timeout} s: {row}"
        time.sleep(1.0)


def detach(path, *script: str) -> str:
    code, out, _ = ddp_up("--detach", str(path), SCRIPT, *script)
    assert code == 0, out
    m = re.search(r"job (\S+) runs detached on \d+ node\(s\)", out)
    assert m, out
    assert f"ddp-attach {path} {m.group(1)}" in out, out
    return m.group(1)


def ticks(output: str) -> list[tuple[int, int]]:
    return [(int(r), int(i)) for i, r in re.findall(r"r\d+ \| tick (\d+) rank=(\d+)$", output, re.M)]


def test_a_detached_job_runs_to_its_end_without_ddp_up_and_every_line_is_shown_once(detached):
    path = detached([(0, 1), (1, 2)], report=True, metrics=True, env={"TICK_SAYS_LOSS": 1})
    job = detach(path, "tick", "16", "1.0")  # 16 s: five times orphan_timeout after ddp-up exits
    assert jobs(path)[job]["state"] == "running"
    deadline = time.monotonic() + 30
    while True:  # ddp-report CLUSTER JOB while it runs: its page so far, partial, with its metrics so far
        code, out = run(REPORT, str(path), job, "--runs-dir", RUNS_ROOT)
        assert code == 0, out
        kept = (run_dir(job) / "metrics.csv").read_text().splitlines()
        if len(kept) > 1 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert len(kept) > 1 and re.search(r",0,loss,1\.0[0-2]?$", kept[1]), kept  # step 0's loss: 1 / (0 + 1) + rank / 100
    assert "(partial: made while the run went on)" in (run_dir(job) / "report.html").read_text()
    row = wait_state(path, job, ("done", "failed", "stopped", "lost"), 90)
    assert row["state"] == "done" and row["exit_status"] == 0 and row["ranks"] == 3, row
    code, out = run(ATTACH, str(path), job, "--runs-dir", RUNS_ROOT)  # a finished job: its whole story
    assert code == 0, out
    seen = ticks(out)
    assert sorted(seen) == [(r, i) for r in range(3) for i in range(16)], out  # every line exactly once
    for r in range(3):
        assert [i for rank, i in seen if rank == r] == list(range(16))  # in order per rank
    assert re.search(r"│ 1\s+│ \S+\s+│ 1-2\s+│ done\s+│ 0", out), out
    logged = [line for line in (run_dir(job) / "rank2.log").read_text().splitlines() if not line.startswith("step ")]
    assert logged == [f"tick {i} rank=2" for i in range(16)]  # the run logs, completed from the nodes
    assert len((run_dir(job) / "metrics.csv").read_text().splitlines()) == 1 + 3 * 16  # every rank's loss, once
    assert json.loads((run_dir(job) / "summary.json").read_text())["script"] == SCRIPT  # as the job's record says
    code, out = run(LOGS, str(path), job, "--runs-dir", RUNS_ROOT)
    assert code == 0, out
    seen = [i for _, i in ticks(out)]  # in time order across nodes (a tick a second), not node by node
    assert sorted(seen) == sorted(i for i in range(16) for _ in range(3)), out
    assert all(max(seen[:at + 1]) - i <= 1 for at, i in enumerate(seen)), out
    code, out = run(LOGS, str(path), job, "--ranks", "1", "--runs-dir", RUNS_ROOT)
    assert code == 0, out
    assert ticks(out) == [(1, i) for i in range(16)], out
    code, out = run(LOGS, str(path), job, "--tail", "6", "--runs-dir", RUNS_ROOT)  # a tick and a loss a step
    assert code == 0, out
    assert sorted(ticks(out)) == [(r, i) for r in range(3) for i in (13, 14, 15)], out
    assert [line for line in (run_dir(job) / "rank2.log").read_text().splitlines()
            if not line.startswith("step ")] == logged  # a tail leaves the run logs whole


def test_a_failing_rank_stops_every_node_and_is_named(cluster, detached):
    path = detached([(0, 1), (1, 1), (2, 1)])
    job = detach(path, "tick", "600", "0.2", "1", "7")
    row = wait_state(path, job, ("failed",), 60)
    assert row["nodes"] == {"0": "stopped", "1": "failed", "2": "stopped"}, row
    assert "(node 1, rank 1) failed (exit code 7)" in row["root_cause"], row
    attached = time.time()
    code, out = run(ATTACH, str(path), job, "--no-dashboard", "--runs-dir", RUNS_ROOT)
    assert code == 1, out
    assert re.search(r"root cause: \S+ \(node 1, rank 1\): rank 1 exited with code 7", out), out
    assert "rank 1 failing with 7" in out
    # issue 26, item 2: a replay reports the job's own times and master, not the attach's
    summary = json.loads((run_dir(job) / "summary.json").read_text())
    began, ended = (datetime.fromisoformat(summary[k]).timestamp() for k in ("started", "ended"))
    assert began < ended < attached and abs((ended - began) - row["duration"]) < 1.0, (summary, row)
    assert re.fullmatch(rf"{re.escape(cluster.nodes[0].addr)}:\d+", summary["master"]), summary
    assert re.search(rf"\(master {re.escape(summary['master'])}\)", out), out
    assert f"master {summary['master']}" in out.splitlines()[0] and ":auto" not in out, out  # its first line too


def test_a_detached_job_that_loses_two_nodes_at_once_goes_on_with_the_one_left(cluster, detached):
    """The fault matrix, detached: nodes 1 and 2 cut off together, `min_nodes: 1`. Its supervisor
    finds both lost, and the job goes on alone on node 0 (world size 1) to its end; ddp-ls shows
    it running there meanwhile; the attach, each attempt with its nodes and both lost nodes out."""
    path = detached([(0, 1), (1, 1), (2, 1)], min_nodes=1, rejoin_after="never", restart_delay=1,
                    env={"TICK_SAYS_WORLD": 1}, ssh={"connect_timeout": 1})
    job = detach(path, "tick", "50", "0.2")
    # nodes 1 and 2 cannot answer ddp-ls: node 0 says the job runs there alone
    cut_until(cluster, cluster.nodes[1:3], path, job, lambda row: row.get("attempt") == 1
              and row["nodes"].get("0") == "running" and row.get("ranks") == 1)
    code, out = run(ATTACH, str(path), job, "--no-dashboard", "--runs-dir", RUNS_ROOT, timeout=90)
    assert code == 0, out
    worlds = worlds_of(out)
    assert worlds == {(0, 0): 3, (0, 1): 3, (0, 2): 3, (1, 0): 1}, out
    attempts = attempts_of(job)
    assert [a.get("end") for a in attempts] == ["lost", "succeeded"], attempts
    assert sorted(attempts[1]["out"]) == sorted(n.addr for n in cluster.nodes[1:3]), attempts
    assert "on 1 of 3 nodes" in attempts[0]["next"], attempts


def test_a_detached_job_whose_rank_fails_as_a_node_drops_restarts_without_that_node(cluster, detached, tmp_path):
    """The fault matrix, detached: rank 0 fails as node 2's link is cut, `min_nodes: 2`,
    `restarts: 1`. The root cause is the rank; node 2, lost in the same attempt, is out of the
    next one, which runs on nodes 0 and 1 to its end."""
    fail_on = tmp_path / "fail-now"
    path = detached([(0, 1), (1, 1), (2, 1)], min_nodes=2, restarts=1, rejoin_after="never", restart_delay=1,
                    env={"TICK_SAYS_WORLD": 1, "TICK_FAIL_ON": str(fail_on)}, ssh={"connect_timeout": 1})
    job = detach(path, "tick", "40", "0.2")
    cut_until(cluster, cluster.nodes[2:3], path, job, lambda row: row.get("attempt") == 1
              and row["nodes"].get("0") == row["nodes"].get("1") == "running", then=fail_on.touch)
    code, out = run(ATTACH, str(path), job, "--no-dashboard", "--runs-dir", RUNS_ROOT, timeout=90)
    assert code == 0, out
    worlds = worlds_of(out)
    # (attempt 0 may end before a rank's first line: rank 0 fails at its first tick)
    assert {k: w for k, w in worlds.items() if k[0] == 1} == {(1, 0): 2, (1, 1): 2}, out
    assert set(w for k, w in worlds.items() if k[0] == 0) <= {3}, out
    attempts = attempts_of(job)
    assert [a.get("end") for a in attempts] == ["failed", "succeeded"], attempts
    assert attempts[1]["out"] == [cluster.nodes[2].addr], attempts


def test_a_detached_job_whose_master_node_is_cut_off_ends_and_says_so(cluster, detached):
    """The fault matrix, detached: the master's node cut off, `min_nodes: 2`. The master's agent is
    the supervisor, so the job cannot go on without it (the elastic guide's limit): the supervisor,
    hearing neither other node at once, says its own node is likely the one cut off, and ends the
    job below min_nodes; the other nodes' agents stop their ranks on its silence. ddp-attach
    names it once the link is back, ddp-kill ends the agents still waiting, and nothing is left."""
    path = detached([(0, 1), (1, 1), (2, 1)], min_nodes=2, rejoin_after="never", restart_delay=1,
                    env={"TICK_SAYS_WORLD": 1}, ssh={"connect_timeout": 1})
    job = detach(path, "tick", "60", "0.2")
    # nodes 1 and 2 answer ddp-ls; node 0 cannot: their ranks stop on their supervisor's silence
    row = cut_until(cluster, cluster.nodes[0:1], path, job, lambda row: row.get("nodes", {}).get("1")
                    not in (None, "running") and row["nodes"].get("2") not in (None, "running"))
    code, out = run(ATTACH, str(path), job, "--no-dashboard", "--runs-dir", RUNS_ROOT, timeout=90)
    assert code == 1, (row, out)
    summary = json.loads((run_dir(job) / "summary.json").read_text())
    # the supervisor's first word, recorded as an attached run's loss: node 1 or 2, whichever's
    # silence it noticed first (both fell silent at once)
    root = summary["root_cause"]
    first = root["node"]
    assert first in (1, 2) and (root["host"], root["kind"]) == (cluster.nodes[first].addr, "lost"), summary
    assert "this master node (node 0) is likely the one cut off" in root["what"], summary
    assert [n["state"] == "lost" for n in summary["nodes"]] == [i == first for i in range(3)], summary
    cause = f"{cluster.nodes[first].addr} (node {first}): no word from its agent for"
    assert re.search(rf"root cause: {re.escape(cause)} \d+ s; every other node fell silent at once", out), out
    # the others' agents, waiting to be taken back, find the master node answering and its
    # supervisor ended: they stop by themselves, at once rather than after rejoin_after's wait
    assert not procs.wait_no_job_processes(job, timeout=30)
    row = jobs(path)[job]
    assert row["state"] == "lost" and row["exit_status"] == 1, row


def test_a_detached_job_that_loses_a_node_in_its_grow_backs_grace_goes_on_with_the_one_that_answered(cluster, detached):
    """The fault matrix, detached: node 2 lost, the job goes on smaller; node 2 answers again and the
    supervisor stops the job to take it back, the ranks saving for 3 s; in that grace node 1 is cut
    (an attach, following, shows when). The next attempt leaves node 1 out and takes node 2 back:
    nodes 0 and 2, gapless; node 1, answering again, is taken back after it, to the job's end."""
    path = detached([(0, 1), (1, 1), (2, 1)], min_nodes=2, rejoin_after=1, restart_delay=1, stop_grace=6,
                    env={"TICK_SAYS_WORLD": 1, "TICK_SAVE_S": 3}, ssh={"connect_timeout": 1})
    job = detach(path, "tick", "60", "0.2")
    with attached(path, job) as follow:
        follow.wait_line(r"r2 \| tick 3 rank=2$", 60)
        cut_until_shown(cluster, cluster.nodes[2], follow, r"r1 \| WORLD 2 rank=1 attempt=1$")
        follow.wait_line(r"r1 \| saving rank=1 attempt=1$", 60)  # the grow's stop: node 1's rank in its grace
        cut_until_shown(cluster, cluster.nodes[1], follow, r"r1 \| WORLD 2 rank=1 attempt=2$")
        code = follow.wait(90)
    out = follow.output
    assert code == 0, out
    attempts = attempts_of(job)
    # node 1, healed once attempt 2 runs without it, answers for rejoin_after: the job grows back again
    assert [a.get("end") for a in attempts] == ["lost", "lost", "stopped to grow", "succeeded"], attempts
    assert attempts[2]["nodes"] == [cluster.nodes[0].addr, cluster.nodes[2].addr], attempts
    assert attempts[1]["root_cause"].startswith(cluster.nodes[1].addr), attempts
    assert attempts[1]["root_cause"] != f"{cluster.nodes[1].addr} lost", attempts  # and why, whoever saw it lost
    assert worlds_of(out).get((2, 0)) == worlds_of(out).get((2, 1)) == 2, out
    assert not procs.wait_no_job_processes(job, timeout=30)


def test_a_detached_job_that_loses_a_node_during_its_restart_delay_goes_on_without_it(cluster, detached, tmp_path):
    """The fault matrix, detached: rank 0 fails, and while the supervisor waits its restart delay
    node 2's link is cut. The restart cannot start there: the job goes on without it on nodes 0
    and 1, gapless, to its end, and the record says node 2 is out."""
    fail_on = tmp_path / "fail-now"
    path = detached([(0, 1), (1, 1), (2, 1)], min_nodes=2, restarts=1, rejoin_after="never", restart_delay=4,
                    env={"TICK_SAYS_WORLD": 1, "TICK_FAIL_ON": str(fail_on)}, ssh={"connect_timeout": 1})
    job = detach(path, "tick", "40", "0.2")
    with attached(path, job) as follow:
        follow.wait_line(r"r2 \| tick 3 rank=2$", 60)
        fail_on.touch()
        follow.wait_line(r"attempt 0 failed .*; attempt 1 \(restart 1 of 1", 60)  # the supervisor's decision: its delay begins
        cut_until_shown(cluster, cluster.nodes[2], follow, r"r1 \| WORLD 2 rank=1 attempt=\d+$", 90)
        code = follow.wait(90)
    out = follow.output
    assert code == 0, out
    attempts = attempts_of(job)
    assert attempts[0]["end"] == "failed" and attempts[-1]["end"] == "succeeded", attempts
    assert attempts[-1]["nodes"] == [n.addr for n in cluster.nodes[:2]], attempts
    assert cluster.nodes[2].addr in attempts[-1]["out"], attempts
    last = len(attempts) - 1
    assert worlds_of(out).get((last, 0)) == worlds_of(out).get((last, 1)) == 2, out
    # while the attach waited for the cut node, holding the others' lines back, it said so
    assert re.search(rf"waiting for {re.escape(cluster.nodes[2].addr)}\b.* to answer: the other nodes' lines are held "
                     r"until then, .* given up on after 11 s\)", out), out
    assert not procs.wait_no_job_processes(job, timeout=30)


def test_a_detached_job_whose_node_flaps_takes_it_back_once_then_goes_on_without_it(cluster, detached):
    """The fault matrix, detached: node 2's link drops, comes back, and drops again. Lost once, it
    is taken back once it answers (the job grows back); lost a second time, it is out for the rest
    of the job, which goes on on nodes 0 and 1 to its end even though node 2 answers again."""
    path = detached([(0, 1), (1, 1), (2, 1)], min_nodes=2, rejoin_after=1, restart_delay=1,
                    env={"TICK_SAYS_WORLD": 1}, ssh={"connect_timeout": 1})
    job = detach(path, "tick", "60", "0.2")
    with attached(path, job) as follow:
        follow.wait_line(r"r2 \| tick 3 rank=2$", 60)
        cut_until_shown(cluster, cluster.nodes[2], follow, r"r1 \| WORLD 2 rank=1 attempt=1$")
        follow.wait_line(r"r2 \| WORLD 3 rank=2 attempt=2$", 60)  # grown back: cut again
        cut_until_shown(cluster, cluster.nodes[2], follow, r"r1 \| WORLD 2 rank=1 attempt=3$")
        code = follow.wait(90)
    out = follow.output
    assert code == 0, out
    attempts = attempts_of(job)
    assert [a.get("end") for a in attempts] == ["lost", "stopped to grow", "lost", "succeeded"], attempts
    assert [len(a["nodes"]) for a in attempts] == [3, 2, 3, 2], attempts
    assert "(node(s) 2 out for the rest of the job, lost or set aside 2 times)" in attempts[2]["next"], attempts
    assert not procs.wait_no_job_processes(job, timeout=30)


def test_an_elastic_detached_job_goes_on_without_a_node_cut_off_and_takes_it_back(cluster, detached):
    """`min_nodes:` with --detach: node 2, cut off, is lost; its own agent stops its part and waits.
    The job's agents go on, on nodes 0 and 1 at world size 2; once node 2 answers again for
    rejoin_after they stop and start the job on all three, which runs to its end. An attach shows
    each attempt with its nodes; nothing of the job is left."""
    # ssh's connect_timeout 1: each ddp-ls while node 2 is cut off waits that long for it, not 5 s
    # (the smaller attempt, 12 s, must still run when the link comes back, under a loaded suite too)
    path = detached([(0, 1), (1, 1), (2, 1)], min_nodes=2, rejoin_after=2, restart_delay=1,
                    env={"TICK_SAYS_WORLD": 1}, report=True, ssh={"connect_timeout": 1})
    job = detach(path, "tick", "60", "0.2")
    # node 2 cannot answer ddp-ls: the others say the job runs without it
    cut_until(cluster, cluster.nodes[2:3], path, job, lambda row: row.get("attempt") == 1
              and row["nodes"].get("0") == row["nodes"].get("1") == "running")
    code, out = run(ATTACH, str(path), job, "--no-dashboard", "--runs-dir", RUNS_ROOT, timeout=90)
    assert code == 0, out
    worlds = worlds_of(out)
    assert worlds == {(0, 0): 3, (0, 1): 3, (0, 2): 3, (1, 0): 2, (1, 1): 2, (2, 0): 3, (2, 1): 3, (2, 2): 3}, out
    assert "attempt 1: 2 node(s)" in out and "attempt 2: 3 node(s)" in out, out
    attempts = attempts_of(job)
    assert [a.get("end") for a in attempts] == ["lost", "stopped to grow", "succeeded"], attempts
    assert re.fullmatch(rf"{re.escape(cluster.nodes[2].addr)} \(node 2\): no word from its agent for \d+ s",
                        attempts[0]["root_cause"]), attempts  # why, as its supervisor found it, worded as attached
    assert attempts[1]["out"] == [cluster.nodes[2].addr] and attempts[2]["out"] == [], attempts  # as attached
    assert "on 2 of 3 nodes (node(s) 2 away)" in attempts[0]["next"], attempts
    assert "stopped to take nodes back on all 3 nodes" in attempts[1]["next"], attempts
    assert out.rstrip().endswith(f"report: {RUNS_ROOT}/{job}/report.html"), out  # its page, from the journals
    kept = [json.loads(line) for line in (run_dir(job) / "timeline.jsonl").read_text().splitlines()]
    spans = [(a["start"], a["end"], len(a["nodes"]), a["end_why"]) for a in kept if a["kind"] == "attempt"]
    assert [s[2:] for s in spans] == [(3, "lost"), (2, "stopped to grow"), (3, "succeeded")], spans
    assert 0 <= spans[0][0] < spans[1][0] < spans[2][0] < spans[2][1] < 60, spans  # the nodes' times, not the replay's
    (run_dir(job) / "report.html").unlink()
    code, out = run(REPORT, str(path), job, "--runs-dir", RUNS_ROOT)  # ddp-report: the same, its lines unshown
    assert code == 0 and out.strip().splitlines()[-1] == f"ddp-report report: {RUNS_ROOT}/{job}/report.html", out
    row = jobs(path)[job]
    assert row["state"] == "done" and row["attempt"] == 2 and set(row["nodes"].values()) == {"done"}, row
    assert not procs.wait_no_job_processes(job, timeout=30)


def test_ctrl_c_detaches_the_attach_and_ddp_kill_stops_the_job(detached):
    path = detached([(0, 1), (1, 1)])
    job = detach(path, "tick", "3000", "0.1")
    attach = Launch([str(path), job, "--no-dashboard", "--runs-dir", RUNS_ROOT], code=ATTACH)
    attach.wait_line(r"r1 \| tick \d+ rank=1", 30)
    attach.signal(signal.SIGINT)
    assert attach.wait(30) == 130, attach.output
    assert "detached; job" in attach.output
    assert jobs(path)[job]["state"] == "running"  # the attach's end is not the job's
    code, out = ddp_kill(str(path), "--job", job)
    assert code == 0, out
    row = wait_state(path, job, ("stopped",), 30)
    assert row["exit_status"] == 1, row


def test_a_torchrun_job_detaches_and_ends_with_its_status(detached):
    path = detached([(0, 1), (1, 1)], launcher="torchrun")
    job = detach(path, "run", "--steps", "3")
    code, out = run(ATTACH, str(path), job, "--no-dashboard", "--runs-dir", RUNS_ROOT, timeout=120)
    assert code == 0, out
    assert len(re.findall(r"\| READY rank=\d world=2", out)) == 2, out


def test_attach_names_an_unreachable_node_and_shows_the_others(cluster, detached):
    path = detached([(0, 1), (1, 1)])
    job = detach(path, "tick", "5", "0.1")
    wait_state(path, job, ("done",), 60)
    doc = yaml.safe_load(path.read_text())
    doc["nodes"][1]["port"] = 1  # nothing listens there: this node cannot be reached
    broken = path.with_name("broken.yaml")
    broken.write_text(yaml.safe_dump(doc))
    code, out = run(ATTACH, str(broken), job, "--no-dashboard", "--runs-dir", RUNS_ROOT)
    assert code == 3, out
    assert ticks(out) == [(0, i) for i in range(5)], out
    assert re.search(rf"{re.escape(cluster.nodes[1].addr)}.*(refused|cannot reach)", out), out


def test_an_unknown_job_gets_one_message_and_leaves_nothing(cluster, detached, tmp_path):
    """Issue 26, item 12: one message (not one per node, and no job header), exit 3, and no run
    directory made for a job that does not exist."""
    path = detached([(0, 1), (1, 1)])
    for tool, extra in ((LOGS, []), (ATTACH, ["--no-dashboard"])):
        code, out = run(tool, str(path), "no-such-job", *extra, "--runs-dir", str(tmp_path / "runs"))
        assert code == 3, out
        assert out.count("no detached job no-such-job") == 1 and "world size" not in out, out
        assert f"on {cluster.nodes[0].addr}, {cluster.nodes[1].addr}: ddp-ls {path} lists the jobs there" in out, out
    assert not (tmp_path / "runs").exists()


@pytest.mark.long
def test_a_detached_hang_is_detected_dumped_stopped_and_named(cluster, detached):
    """The supervisor sees no line from any rank for hang_timeout, has every rank print its stack,
    stops the job; an attach names the odd rank out from the stacks in the journals. Rank 0 takes
    longer than hang_timeout to reach init_process_group (a slow import): start-up is no hang."""
    path = detached([(0, 1), (1, 2)], launcher="torchrun", hang_timeout=10,
                    env={"OMP_NUM_THREADS": 1, "PATH": "/usr/bin:/bin",  # no py-spy: the dump hook
                         "JOB_SLOW_RANK": 0, "JOB_INIT_DELAY": 12})
    job = detach(path, "hang")
    row = wait_state(path, job, ("failed", "stopped", "done"), 120)
    assert row["state"] == "failed" and row["root_cause"].startswith("job hung (no output from any rank"), row
    code, out = run(ATTACH, str(path), job, "--no-dashboard", "--runs-dir", RUNS_ROOT)
    assert code == 1, out
    b = re.escape(cluster.nodes[1].addr)
    assert re.search(rf"^{b}\s+r2\s+! .*line \d+ in block_forever$", out, re.M), out
    a = re.escape(cluster.nodes[0].addr)  # issue 28: the records in the journals say who everyone waits for
    assert re.search(rf"root cause: {a} \(node 0, rank 0\): job hung \(no output from any rank for \d+ s\); "
                     r"ranks 0-1 never entered all_reduce #2 on the default group \(Flight Recorder\); "
                     r"rank 2 in all_reduce \(from block_forever\)", out), out
    assert "collectives: Flight Recorder: on the default group, every rank completed all_reduce #1; " in out, out


def test_a_detached_job_restarts_by_itself_and_an_attach_shows_every_attempt(detached):
    """Issue 18 with --detach: rank 1 fails in attempt 0; the job's own agents (no ddp-up) start
    attempt 1, which runs to its end. An attach from the start follows it live through the
    restart; ddp-logs afterwards replays both attempts, in order."""
    path = detached([(0, 1), (1, 1)], restarts=2, restart_delay=1, master={"port": 29731},
                    env={"TICK_SAYS_PORT": 1})  # each attempt on the port the cluster file sets
    code, out, _ = ddp_up("--detach", str(path), SCRIPT, "tick", "6", "0.3", "1", "7", "0")
    assert code == 0 and "on a failure its own agents start it again, up to 2 time(s)" in out, out
    job = re.search(r"job (\S+) runs detached", out).group(1)
    code, out = run(ATTACH, str(path), job, "--no-dashboard", "--runs-dir", RUNS_ROOT)
    assert code == 0, out
    first, _, second = out.partition("attempt 1: 2 node(s)")
    assert second, out
    assert [i for r, i in ticks(first) if r == 1] == [0, 1, 2] and "rank 1 failing with 7" in first, out
    assert sorted(ticks(second)) == [(r, i) for r in range(2) for i in range(6)], out  # attempt 1, whole
    assert sorted(re.findall(r"PORT (\d+) attempt=(\d)$", out, re.M)) == [("29731", "0")] * 2 + [("29731", "1")] * 2
    assert re.search(r"job \S+ ok after [\d.]+ s in 2 attempts \(exit status 0\)", out), out
    attempts = attempts_of(job)
    assert [a["attempt"] for a in attempts] == [0, 1] and "(node 1, rank 1)" in attempts[0]["root_cause"], attempts
    assert (run_dir(job) / "attempt1" / "rank1.log").read_text().splitlines() == \
        ["PORT 29731 attempt=1"] + [f"tick {i} rank=1" for i in range(6)]
    row = jobs(path)[job]
    assert row["state"] == "done" and row["exit_status"] == 0 and row["attempt"] == 1, row
    code, out = run(LOGS, str(path), job, "--ranks", "1", "--runs-dir", RUNS_ROOT)  # the story, replayed
    assert code == 0, out
    assert ticks(out) == [(1, i) for i in (0, 1, 2)] + [(1, i) for i in range(6)], out
    assert not procs.wait_no_job_processes(job, timeout=30)


@pytest.mark.parametrize("launcher", ["none", "torchrun"])
def test_a_detached_warm_job_restarts_warm(detached, launcher):
    """Warm start and a detached restart: each node's next interpreter was made as the attempt
    before began (tagged with its own attempt, so that attempt's end left it alone), and the
    restarted ranks are forked from it."""
    # the next interpreter imports while attempt 0 runs and waits its delay: a restart is warm once it is ready
    path = detached([(0, 1), (1, 1)], launcher=launcher, warm=True, restarts=1, restart_delay=6)
    code, out, _ = ddp_up("--detach", str(path), SCRIPT, "run", "--fail-rank", "1", "--exit-code", "3",
                          "--fail-attempts", "0", timeout=180)
    assert code == 0, out
    job = re.search(r"job (\S+) runs detached", out).group(1)
    code, out = run(ATTACH, str(path), job, "--no-dashboard", "--runs-dir", RUNS_ROOT)
    assert code == 0 and re.search(r"ok after [\d.]+ s in 2 attempts", out), out
    assert sorted(re.findall(r"READY rank=(\d) world=2 .* warm=(\w+) attempt=1$", out, re.M)) == \
        [("0", "True"), ("1", "True")], out
    assert "SignalException" not in out, out  # torchrun's report of the stop the supervisor made: the log's, as attached
    assert not procs.wait_no_job_processes(job, timeout=30)


def test_a_detached_job_restarts_by_the_rules_an_attached_one_does(detached):
    """Its supervisor decides by the same rule as ddp-up (policy.next_attempt): an exit code that
    no_restart_on_exit lists ends it at once, restarts left or not; the same failure three times
    in a row, each as early, is a crash loop, and no fourth attempt is made. ddp-ls says why."""
    path = detached([(0, 1), (1, 1)], restarts=5, restart_delay=0.5, no_restart_on_exit=[3])
    job = detach(path, "tick", "20", "0.2", "1", "3")  # rank 1 exits 3 at its third tick
    row = wait_state(path, job, ("done", "failed", "stopped", "lost"), 60)
    assert row["state"] == "failed" and row["attempt"] == 0, row  # no restart: 3 is listed
    assert row["root_cause"].endswith("failed (exit code 3)"), row
    loop = detached([(0, 1), (1, 1)], restarts=5, restart_delay=0.5)
    job = detach(loop, "tick", "20", "0.2", "1", "7")  # the same exit 7 at the same tick, every attempt
    row = wait_state(loop, job, ("done", "failed", "stopped", "lost"), 90)
    assert row["state"] == "failed" and row["attempt"] == 2, row  # attempts 0, 1, 2: then the crash loop
    assert row["attempts"][0].endswith("-> restart 1 of 5") and row["attempts"][1].endswith("-> restart 2 of 5"), row
    assert "-> crash loop: attempts 0 to 2 failed the same way" in row["attempts"][2], row


def test_under_torchrun_a_detached_job_reads_the_ranks_own_exit_code(detached):
    """torchrun exits 1 for any failed rank: the supervisor compared that, and a rank's exit 3 that
    no_restart_on_exit lists ran every restart. The node reads the rank's code from torchrun's
    failure report, as ddp-up does attached (node/watch/report.py, one reader for both)."""
    path = detached([(0, 1), (1, 1)], restarts=3, restart_delay=0.5, no_restart_on_exit=[3], launcher="torchrun")
    job = detach(path, "tick", "20", "0.2", "1", "3")  # rank 1 exits 3 at its third tick
    row = wait_state(path, job, ("done", "failed", "stopped", "lost"), 90)
    assert row["state"] == "failed" and row["attempt"] == 0, row  # no restart: 3 is listed
    assert row["root_cause"].endswith("failed (exit code 3)"), row
    assert not procs.wait_no_job_processes(job, timeout=30)


def test_a_detached_hang_is_a_failure_kind_of_its_own_and_takes_a_restart(detached):
    """The supervisor names a hang's kind as ddp-up does (hung: the job's own, so `restarts:` pays,
    never `recoveries:`), stops the hung attempt, starts the next; ddp-ls and the attach's
    summary.json say so, as for an attached run."""
    path = detached([(0, 1), (1, 1)], restarts=1, recoveries=0, hang_timeout=5, restart_delay=0.5)
    job = detach(path, "tick", "6", "0.2", "1", "hang", "0")  # rank 1 goes silent at its third tick, attempt 0
    row = wait_state(path, job, ("done", "failed", "stopped", "lost"), 90)
    assert row["state"] == "done" and row["attempt"] == 1, json.dumps(row)
    assert "job hung (no output from any rank" in row["attempts"][0], row
    assert row["attempts"][0].endswith("-> restart 1 of 1"), row
    code, out = run(ATTACH, str(path), job, "--no-dashboard", "--runs-dir", RUNS_ROOT)
    assert code == 0, out
    attempts = attempts_of(job)
    assert [(a["attempt"], a["end"], a["next"]) for a in attempts] == [(0, "hung", "restart 1 of 1"),
                                                                      (1, "succeeded", None)], attempts


def test_ddp_kill_while_a_detached_job_waits_to_restart_ends_it_for_good(detached):
    path = detached([(0, 1), (1, 1)], restarts=3, restart_delay=60)
    job = detach(path, "tick", "600", "0.2", "1", "7")
    row = wait_state(path, job, ("restarting",), 60)
    code, out = ddp_kill(str(path), "--job", job)
    assert code == 0, out
    row = wait_state(path, job, ("failed", "stopped"), 30)
    assert row["state"] == "stopped" and row["nodes"] == {"0": "stopped", "1": "stopped"}, row  # issue 26, item 2
    assert row["attempt"] == 0 and row["exit_status"] == 1, row
    assert "(node 1, rank 1) failed (exit code 7)" in row["root_cause"], row
    assert not procs.wait_no_job_processes(job, timeout=30)


def test_a_detached_jobs_secrets_stay_masked_for_an_attach_that_does_not_know_them(detached, tmp_path):
    """Issue 26, item 4: ddp-logs and ddp-attach printed forward_env: and env_file: secrets in
    clear (and wrote them to the run logs) when the shell or cluster file that attaches does not
    hold them: the job's own agents mask them in its journal and records."""
    env_file = tmp_path / "job.env"
    env_file.write_text("HF_API_KEY=hf-file-secret-5678\n")
    path = detached([(0, 1), (1, 1)], forward_env=["DDP_TEST_TOKEN"], env_file=str(env_file))
    launch = Launch(["--detach", str(path), SCRIPT, "env", "DDP_TEST_TOKEN", "HF_API_KEY"],
                    env={"DDP_TEST_TOKEN": "tok-forwarded-1234"})
    assert launch.wait(60) == 0, launch.output
    job = re.search(r"job (\S+) runs detached", launch.output).group(1)
    wait_state(path, job, ("done",), 60)
    env_file.unlink()  # the attaching side knows neither secret now
    code, out = run(LOGS, str(path), job, "--runs-dir", RUNS_ROOT)
    assert code == 0, out
    assert re.search(r"r1 \| ENV DDP_TEST_TOKEN=\*\*\*$", out, re.M) and "ENV HF_API_KEY=***" in out, out
    code, out = run(ATTACH, str(path), job, "--no-dashboard", "--runs-dir", RUNS_ROOT)
    assert code == 0, out
    kept = "".join(p.read_text() for p in run_dir(job).rglob("*") if p.is_file())
    for secret in ("tok-forwarded-1234", "hf-file-secret-5678"):
        assert secret not in out and secret not in kept


def test_a_setup_that_moves_tmpdir_hides_no_detached_job(detached, tmp_path):
    """Issue 26, item 9: `setup: export TMPDIR=...` put the job's state where ddp-ls, ddp-logs
    and ddp-kill --purge (which run no setup) never looked. The job still gets setup's TMPDIR."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    path = detached([(0, 1)], setup=[f"export TMPDIR={scratch}"])
    job = detach(path, "env", "TMPDIR")
    wait_state(path, job, ("done",), 60)
    code, out = run(LOGS, str(path), job, "--runs-dir", RUNS_ROOT)
    assert code == 0 and f"ENV TMPDIR={scratch}" in out, out
    code, out = ddp_kill(str(path), "--job", job, "--purge")
    assert code == 0 and f"removed the state of {job} node0" in out, out
    assert job not in jobs(path)


def test_ddp_logs_into_a_pipe_that_closes_ends_quietly(detached):
    """Issue 26, item 12: `ddp-logs ... | head` said "stdout is gone ...; the job goes on" about a
    job that had ended. A reader whose stdout goes ends there, as a reader in a pipe does (141)."""
    import subprocess
    import sys

    from tests.harness.runner import REPO, _env
    path = detached([(0, 1)])
    job = detach(path, "tick", "5000", "0")  # more than a pipe holds: the reader meets the closed end
    wait_state(path, job, ("done",), 60)
    reader = subprocess.Popen([sys.executable, "-c", LOGS, str(path), job, "--runs-dir", RUNS_ROOT], cwd=REPO,
                              env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    assert b"| tick 0 rank=0" in reader.stdout.readline()
    reader.stdout.close()  # as head does after its lines
    try:
        assert reader.wait(60) == 141
    finally:
        reader.kill()
    assert reader.stderr.read() == b""


def test_ddp_kill_of_a_detached_job_gives_every_rank_its_grace_to_save(detached, tmp_path):
    """Issue 27, item 6: a detached job's ddp-kill: every rank gets SIGTERM once and the whole
    stop_grace to save; the job ends stopped."""
    path = detached([(0, 1), (1, 1)], stop_grace=15, env={"OMP_NUM_THREADS": 1, "SAVE_S": "3"})
    job = detach(path, "save", str(tmp_path / "ckpt"))
    attach = Launch([str(path), job, "--no-dashboard", "--runs-dir", RUNS_ROOT], code=ATTACH)
    for rank in (0, 1):  # its handler is in place
        attach.wait_line(rf"r{rank} \| rank {rank} SHUTDOWN_TIMEOUT=\S+ running", 60)
    attach.signal(signal.SIGINT)
    assert attach.wait(30) == 130, attach.output
    code, out = ddp_kill(str(path), "--job", job)
    assert code == 0, out
    for rank in (0, 1):
        assert (tmp_path / f"ckpt.{rank}").read_text() == "saved\n", out
    row = wait_state(path, job, ("stopped",), 30)
    assert row["exit_status"] == 1, row


def test_a_nodes_command_jobs_own_record_of_its_nodes_lists_and_stops_it(cluster, detached, tmp_path):
    """A detached job from `nodes_command:`: once the program fails (a cloud's API down) ddp-ls
    still lists the job, saying why; once it lists other hosts (a spot pool replaced), ddp-kill
    --job still reaches the job's own nodes and stops it."""
    path = detached([(0, 1)])
    hosts = tmp_path / "hosts.txt"
    listed = "".join(f"{n.addr} slots=1\n" for n in cluster.nodes[:2])
    hosts.write_text(listed)
    doc = yaml.safe_load(path.read_text())
    del doc["nodes"]
    path.write_text(yaml.safe_dump({**doc, "nodes_command": f"cat {hosts}"}))
    job = detach(path, "tick", "3000", "0.1")
    try:
        hosts.unlink()  # the program fails
        code, out = run(LS, str(path), "--json", "--runs-dir", RUNS_ROOT)
        assert code == 0 and "going on with the nodes the jobs started from it recorded" in out, out
        rows = {row["job"]: row for row in map(json.loads, (line for line in out.splitlines() if line.startswith("{")))}
        assert rows[job]["state"] == "running", out
        hosts.write_text(f"{cluster.nodes[3].addr} slots=1\n")  # other hosts now
        code, out = ddp_kill(str(path), "--job", job, "--runs-dir", RUNS_ROOT)
        assert code == 0 and cluster.nodes[1].addr in out and cluster.nodes[3].addr not in out, out
        hosts.write_text(listed)
        assert wait_state(path, job, ("stopped",), 30)["exit_status"] == 1
    finally:
        hosts.write_text(listed)  # the fixture's sweep reaches the job's nodes
