"""Faults that come together, on the sshd cluster: two nodes cut off at once, a rank failing as a
node drops, under `min_nodes:`, `spares:` and plain `restarts:`. Every run goes on as the restarts
guide says, or ends, within a bound; a stop (Ctrl-C) is honoured in the smaller run; every attempt's
ranks are gapless; its record (summary.json) is whole; nothing is left on any node (the leak check).

Table-driven: one case a row, each a test of its own (the workers share them out). The workload is
job.py's tick (no torch): rank 0 of the first attempt fails when the test says (TICK_FAIL_ON)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.harness.runner import Launch, run_dir
from tests.integration.conftest import SCRIPT

THIEF = str(Path(SCRIPT).with_name("port_thief.py"))

LAUNCHER = "none"
STOP_BOUND = 20.0  # seconds from a Ctrl-C to ddp-up's exit: stop_grace (2) and the sweeps' bounds


@dataclass(frozen=True)
class Case:
    settings: dict
    layout: int  # nodes listed (node 0 first), one rank each
    cut: tuple[int, ...]  # the nodes whose links are cut together
    rank_fails: bool  # rank 0 fails as they drop
    then: tuple[int, ...] | None  # the nodes of attempt 1 (None: no attempt 1 runs the job)
    code: int  # ddp-up's exit status
    said: tuple[str, ...] = field(default=())  # words the run must say ({n}: node n's address)


CASES = {
    "two-lost-min-nodes": Case({"min_nodes": 1}, 3, (1, 2), False, (0,), 130,
                               ("{1} is out until it answers again (lost)", "{2} is out until it answers again (lost)")),
    # the node whose silence is noticed first (1 or 2) is the root cause, and the spare takes its place
    "two-lost-spares": Case({"spares": 1}, 4, (1, 2), False, None, 1,
                            ("spare {3} takes its place as node ", "no spare is left (set `spares:`")),
    # the master's node cut off: the run goes on with the master on the first node left
    "master-lost-min-nodes": Case({"min_nodes": 2}, 3, (0,), False, (1, 2), 130,
                                  ("{0} is out until it answers again (lost)",)),
    "two-lost-below-min-nodes": Case({"min_nodes": 2}, 3, (1, 2), False, None, 1,
                                     ("fewer than min_nodes (2)",)),
    "rank-fails-as-node-drops-min-nodes": Case({"min_nodes": 2, "restarts": 1}, 3, (2,), True, (0, 1), 130,
                                               ("{2} is out until it answers again (lost)",)),
    "rank-fails-as-node-drops-spares": Case({"spares": 1, "restarts": 1}, 4, (2,), True, (0, 1, 3), 130,
                                            ("spare {3} takes its place as node 2",)),
    # without spares or min_nodes every attempt runs on the nodes listed: the cut one cannot start
    "rank-fails-as-node-drops-restarts": Case({"restarts": 1, "recoveries": 1, "ssh": {"connect_timeout": 2}}, 3, (2,),
                                              True, None, 1, ("could not start",)),
}


def attempts_of(out: str) -> list[dict]:
    """The run's attempts, as its summary.json keeps them."""
    return json.loads((run_dir(re.search(r"job (\d{8}-\d{6}-\w+)", out).group(1)) / "summary.json").read_text())["attempts"]


def shrunk_by_node_2(cluster, launch: Launch) -> None:
    """Node 2's link cut once the run is under way, and healed once attempt 1 runs without it."""
    launch.wait_line(r"r2 \| tick 3 rank=2$", 120)
    cluster.partition(cluster.nodes[2])
    launch.wait_line(r"\| WORLD 2 rank=1 attempt=1$", 120)
    cluster.heal(cluster.nodes[2])


def ctrl_c_within_bound(launch: Launch) -> int:
    """Ctrl-C; ddp-up's exit status, which came within STOP_BOUND."""
    launch.signal(signal.SIGINT)
    asked = time.monotonic()
    code = launch.wait(STOP_BOUND + 10)
    assert time.monotonic() - asked < STOP_BOUND, launch.output
    return code


@pytest.mark.parametrize("name", CASES)
def test_faults_together_end_or_go_on_within_a_bound(name, cluster, cluster_file, tmp_path):
    case = CASES[name]
    nodes = cluster.nodes
    fail_on = tmp_path / "fail-now"
    path = cluster_file([(i, 1) for i in range(case.layout)], orphan_timeout=3, restart_delay=0.2, stop_grace=2,
                        **case.settings, env={"OMP_NUM_THREADS": 1, "TICK_SAYS_WORLD": 1, "TICK_FAIL_ON": str(fail_on)})
    launch = Launch([str(path), SCRIPT, "tick", "600", "0.1"])
    try:
        launch.wait_line(r"r0 \| tick 3 rank=0$", 120)
        for i in case.cut:
            cluster.partition(nodes[i])
        if case.rank_fails:
            fail_on.touch()
        if case.then is not None:
            world = len(case.then)
            for rank in range(world):  # the smaller run's ranks, gapless
                launch.wait_line(rf"\| WORLD {world} rank={rank} attempt=1$", 120)
            launch.wait_line(rf"r{world - 1} \| tick 3 rank={world - 1}$", 60)
            code = ctrl_c_within_bound(launch)
        else:
            code = launch.wait(120)
    finally:
        for i in case.cut:
            cluster.heal(nodes[i])
        launch.proc.kill()
    out = launch.output
    assert code == case.code, out
    for words in case.said:
        assert words.format(*[n.addr for n in nodes]) in out, (words, out)
    attempts = attempts_of(out)
    assert attempts[0]["nodes"] == [nodes[i].addr for i in range(case.layout - case.settings.get("spares", 0))]
    if case.then is not None:
        moved = re.search(rf"attempt 1: {len(case.then)} node\(s\) .*; master {re.escape(nodes[case.then[0]].addr)}\b", out)
        assert bool(moved) == (0 in case.cut), out  # the master moves with its node, and only then
    if case.then is not None:
        assert [a["nodes"] for a in attempts[1:]] == [[nodes[i].addr for i in case.then]], attempts
        assert attempts[1]["world_size"] == len(case.then) and attempts[1]["end"] == "stopped", attempts
        assert all(nodes[i].addr in attempts[1]["out"] for i in case.cut), attempts
    elif case.settings.get("restarts"):
        assert all(nodes[2].addr in a["nodes"] for a in attempts) and attempts[-1]["end"] == "could not start"
    else:
        assert len(attempts) == 1, attempts
    assert "answered again afterwards" not in out, out  # no cut node ran a later attempt


def test_ranks_stuck_in_a_collective_with_a_lost_node_are_not_waited_for(cluster, cluster_file, tmp_path):
    """A node lost mid-step: the others' ranks sit in an all_reduce that waits on its ranks, where
    their stop handlers cannot run; they were waited on for the whole stop_grace (60 s here), and
    are now ended once their Flight Recorder shows them stuck, each named with its collective."""
    path = cluster_file([(0, 1), (1, 1), (2, 1)], launcher="torchrun", min_nodes=2, orphan_timeout=3,
                        restart_delay=0.2, stop_grace=60, rejoin_after="never",
                        env={"OMP_NUM_THREADS": 1, "JOB_TERM_HANDLER": 1, "JOB_PG_TIMEOUT": 120})
    launch = Launch([str(path), SCRIPT, "collectives", "balanced", "100000", "0.05"])
    try:
        launch.wait_line(r"r2 \| step 20 rank=2$", 120)
        cluster.partition(cluster.nodes[2])
        launch.wait_line(r"lost \(no heartbeat", 60)
        lost = time.monotonic()
        launch.wait_line(r"READY rank=1 world=2 .* attempt=1", 120)
        took = time.monotonic() - lost
        launch.signal(signal.SIGINT)
        code = launch.wait(90)
    finally:
        cluster.heal(cluster.nodes[2])
        launch.proc.kill()
    out = launch.output
    assert code == 130, out
    assert took < 40, (took, out)  # not stop_grace's 60 s
    assert re.search(r"ddp-up: rank [01] was in \S+ #\d+, which cannot complete without the node lost", out), out


def test_a_master_port_taken_before_the_launcher_binds_it_is_tried_again_on_another(cluster, cluster_file):
    """Another program takes the `auto` master port between the node's check of it and torchrun's
    bind (the thief binds it the moment the node agent lets it go): the launcher fails at its store,
    and ddp-up starts the attempt again at once on a fresh port, using no restart (none is set)."""
    master = cluster.nodes[0]
    path = cluster_file([(0, 1), (1, 1)], launcher="torchrun", restarts=0)
    for _ in range(3):  # the thief races the launcher's own bind at Go: it wins nearly always, not always
        thief = subprocess.Popen(["ip", "netns", "exec", master.name, sys.executable, THIEF, "90"], text=True,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            assert thief.stdout.readline().strip() == "watching"
            launch = Launch([str(path), SCRIPT, "tick", "3", "0.01"])
            code = launch.wait(120)
            stolen = thief.stdout.readline().split()
        finally:
            thief.stdin.close()
            thief.wait(10)
        out = launch.output
        if "EADDRINUSE" in out or code != 0:
            break
    assert stolen[0] == "stole", (stolen, out)
    assert code == 0, out
    assert re.search(rf"launcher exited with code 1: \S*DistNetworkError: .*port: {stolen[1]}, .*EADDRINUSE", out), out
    assert "attempt 1 (the master port was taken before the launcher could listen on it: again on another port " \
           "(1 of 3; restarts: untouched)) in 0.25 s" in out, out
    assert re.search(r"ok after [\d.]+ s in 2 attempts", out), out


def test_a_node_lost_during_the_restart_delay_is_left_out_of_the_next_attempt(cluster, cluster_file, tmp_path):
    """A rank fails; while the run waits to restart, another node's link is cut. The restart cannot
    start there (it could not start, a recovery): the attempt after goes on without it, as
    min_nodes allows, and a Ctrl-C ends it."""
    nodes, fail_on = cluster.nodes, tmp_path / "fail-now"
    path = cluster_file([(0, 1), (1, 1), (2, 1)], orphan_timeout=3, restart_delay=3, stop_grace=2, restarts=1,
                        min_nodes=2, rejoin_after="never", ssh={"connect_timeout": 2},
                        env={"OMP_NUM_THREADS": 1, "TICK_SAYS_WORLD": 1, "TICK_FAIL_ON": str(fail_on)})
    launch = Launch([str(path), SCRIPT, "tick", "600", "0.1"])
    try:
        launch.wait_line(r"r2 \| tick 3 rank=2$", 120)
        fail_on.touch()
        launch.wait_line(r"attempt 0 failed .*; attempt 1 .* in 3 s", 60)
        cluster.partition(nodes[2])
        for rank in range(2):
            launch.wait_line(rf"\| WORLD 2 rank={rank} attempt=2$", 120)
        launch.wait_line(r"r1 \| tick 3 rank=1$", 60)
        launch.signal(signal.SIGINT)
        code = launch.wait(STOP_BOUND + 10)
    finally:
        cluster.heal(nodes[2])
        launch.proc.kill()
    out = launch.output
    assert code == 130, out
    attempts = attempts_of(out)
    assert [a["end"] for a in attempts] == ["failed", "could not start", "stopped"], attempts
    assert attempts[2]["nodes"] == [nodes[0].addr, nodes[1].addr] and nodes[2].addr in attempts[2]["out"], attempts
    assert f"{nodes[2].addr} is out until it answers again (lost)" in out, out


def test_a_node_that_flaps_comes_back_once_then_is_out_for_the_rest_of_the_run(cluster, cluster_file):
    """A link that drops, comes back, and drops again: lost once, the node is away and rejoins once
    it answers (the run grows back); lost a second time, it is out for good, and the run goes on
    without it as min_nodes allows."""
    nodes = cluster.nodes
    path = cluster_file([(0, 1), (1, 1), (2, 1)], orphan_timeout=3, restart_delay=0.2, stop_grace=2, min_nodes=2,
                        rejoin_after=1, env={"OMP_NUM_THREADS": 1, "TICK_SAYS_WORLD": 1})
    launch = Launch([str(path), SCRIPT, "tick", "600", "0.1"])
    try:
        shrunk_by_node_2(cluster, launch)
        launch.wait_line(r"\| WORLD 3 rank=2 attempt=2$", 120)
        launch.wait_line(r"r2 \| tick 3 rank=2$", 60)
        cluster.partition(nodes[2])
        launch.wait_line(r"\| WORLD 2 rank=1 attempt=3$", 120)
        cluster.heal(nodes[2])
        launch.wait_line(r"r1 \| tick 3 rank=1$", 60)
        launch.signal(signal.SIGINT)
        code = launch.wait(STOP_BOUND + 10)
    finally:
        cluster.heal(nodes[2])
        launch.proc.kill()
    out = launch.output
    assert code == 130, out
    assert f"{nodes[2].addr} is out for the rest of the run (lost twice)" in out, out
    attempts = attempts_of(out)
    assert [len(a["nodes"]) for a in attempts] == [3, 2, 3, 2], attempts
    assert [a["end"] for a in attempts] == ["lost", "stopped to grow", "lost", "stopped"], attempts


def test_a_node_lost_during_the_grow_backs_grace_is_left_out_of_the_grown_attempt(cluster, cluster_file):
    """Node 2 is lost and the run goes on smaller; once it answers again the run stops to grow back,
    with the ranks' grace (they save for 3 s); in that grace node 1's link is cut. The loss ends that
    attempt; node 2, which answered, is taken back all the same: the run goes on without node 1 on
    nodes 0 and 2, gapless, and a Ctrl-C ends it."""
    nodes = cluster.nodes
    path = cluster_file([(0, 1), (1, 1), (2, 1)], orphan_timeout=3, restart_delay=0.2, stop_grace=6, min_nodes=2,
                        rejoin_after=1, recoveries=2, ssh={"connect_timeout": 2},
                        env={"OMP_NUM_THREADS": 1, "TICK_SAYS_WORLD": 1, "TICK_SAVE_S": 3})
    launch = Launch([str(path), SCRIPT, "tick", "600", "0.1"])
    try:
        shrunk_by_node_2(cluster, launch)
        launch.wait_line(r"\| saving rank=1 attempt=1$", 120)  # the grow's stop: node 1's rank in its grace
        cluster.partition(nodes[1])
        last = int(re.search(r"attempt=(\d+)$", launch.wait_line(r"\| WORLD 2 rank=1 attempt=([2-9]|\d\d)$", 120))[1])
        launch.wait_line(rf"\| WORLD 2 rank=0 attempt={last}$", 60)
        code = ctrl_c_within_bound(launch)
    finally:
        cluster.heal(nodes[1])
        cluster.heal(nodes[2])
        launch.proc.kill()
    out = launch.output
    assert code == 130, out
    attempts = attempts_of(out)
    assert [a["end"] for a in attempts] == ["lost", "lost", "stopped"], attempts  # the loss ends the grow's stop
    assert attempts[1]["root_cause"].startswith(f"{nodes[1].addr} (node 1): "), attempts
    # the grow, overtaken, still takes it back; the run goes on with 2 nodes, node 1 leaving
    assert f"{nodes[2].addr} answers again: it rejoins the run, which goes on with 2 node(s)" in out, out
    assert attempts[2]["nodes"] == [nodes[0].addr, nodes[2].addr] and attempts[2]["world_size"] == 2, attempts
    assert attempts[2]["out"] == [nodes[1].addr] and last == 2, (last, attempts)
    assert not re.search(rf"{re.escape(nodes[1].addr)}: .*answered again afterwards", out), out  # node 1 never did
