"""`nodes_command:`: a program's output is the node list, at the launch and before each attempt.
Real /bin/sh programs, the real validator, the roster's rule; milliseconds each but the timeout."""

from __future__ import annotations

import subprocess
import time

import pytest

from orchestrator.config import nodescommand
from orchestrator.config.clusterfile import parse_cluster, relisted
from orchestrator.errors import ConfigError, UsageError
from orchestrator.run.attempts import Restarts
from orchestrator.run.roster import Roster


def left_running(marker: str) -> list[str]:
    """The processes whose command line holds ``marker``, once those being killed are gone (a
    SIGKILL takes effect as the kernel gets to it: bounded)."""
    deadline = time.monotonic() + 10
    while True:
        left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def cluster_text(command: str, **top) -> str:
    head = "".join(f"{k}: {v}\n" for k, v in top.items())
    return f"{head}nodes_command: {command!r}\npython: /opt/py/bin/python3\n"


def test_the_programs_hostfile_is_the_node_list_with_the_files_settings(tmp_path):
    (tmp_path / "list.sh").write_text("#!/bin/sh\n# the pool\necho 'gpu-a slots=2'\necho 'gpu-b slots=4  # new'\n")
    (tmp_path / "list.sh").chmod(0o755)
    config = parse_cluster(cluster_text("./list.sh", min_nodes=1), str(tmp_path / "c.yaml"))  # run in the file's folder
    assert [(n.label, n.gpus, n.python) for n in config.nodes] == [("gpu-a", 2, "/opt/py/bin/python3"),
                                                                   ("gpu-b", 4, "/opt/py/bin/python3")]
    assert config.nodes_command == "./list.sh" and config.min_nodes == 1


@pytest.mark.parametrize("command, says", [
    ("echo 'gpu-a slots=x'", "slots must be an integer from 1 to 4096, got 'x' (line 1 of its output)"),
    ("echo nope >&2; exit 3", "exited with status 3: nope; it must print one `HOST slots=N` line a node and exit 0"),
    ("kill -9 $$", "exited with signal 9; it must print"),
    ("echo '# none today'", "printed no host; it must print one `HOST slots=N` line a node"),
    ("head -c 2000000 /dev/zero | tr '\\0' x", "printed more than 1 MiB"),
    ("echo '-oProxyCommand=x slots=1'", "the host"),
])
def test_a_program_that_fails_or_prints_no_list_is_one_error_naming_the_key(tmp_path, command, says):
    with pytest.raises(ConfigError) as e:
        parse_cluster(cluster_text(command), str(tmp_path / "c.yaml"))
    assert says in e.value.render() and e.value.key.startswith("nodes") and e.value.line is not None, e.value.render()


def test_a_program_that_does_not_end_is_stopped_with_everything_it_started(tmp_path, monkeypatch):
    monkeypatch.setattr(nodescommand, "COMMAND_WAIT", 0.5)
    marker = f"{tmp_path}/never-ends"
    with pytest.raises(ConfigError) as e:
        parse_cluster(cluster_text(f"sh -c 'sleep 60; echo {marker}' & sh -c 'sleep 60; echo {marker}'"),
                      str(tmp_path / "c.yaml"))
    assert "did not finish within" in e.value.render() and "it must print the node list and exit" in e.value.render()
    assert not left_running(marker)  # its whole group: the child it left in the background too


def test_what_a_program_leaves_running_is_stopped_when_it_ends(tmp_path):
    marker = f"{tmp_path}/left-behind"
    config = parse_cluster(cluster_text(f"sh -c 'sleep 60; echo {marker}' & echo a slots=1"), str(tmp_path / "c.yaml"))
    assert [n.label for n in config.nodes] == ["a"]
    assert not left_running(marker)


def test_a_child_that_left_the_programs_session_is_stopped_too(tmp_path):
    """setsid takes a child out of the program's group: the mark in its environment still finds it."""
    marker = f"{tmp_path}/own-session"
    config = parse_cluster(cluster_text(f"setsid sh -c 'sleep 60; echo {marker}' >/dev/null 2>&1 & echo a slots=1"),
                           str(tmp_path / "c.yaml"))
    assert [n.label for n in config.nodes] == ["a"]
    assert not left_running(marker)


@pytest.mark.parametrize("command, says", [
    ("yes a slots=1", "printed more than 1 MiB"),  # a flood: stopped as it passes the bound, not at the timeout
    ("yes x >&2", "printed more than 1 MiB"),
    ("printf 'gpu-\\377 slots=1\\n'", "printed bytes that are not UTF-8"),
    ("seq -f 'h%g slots=1' 70000", "more than 65536 hosts"),
    ("printf '%0200000d slots=1\\n' 0", "more than any host name (255)"),
])
def test_what_a_program_prints_is_bounded_as_it_prints_it(tmp_path, command, says):
    started = time.monotonic()
    with pytest.raises(ConfigError) as e:
        parse_cluster(cluster_text(command), str(tmp_path / "c.yaml"))
    assert says in e.value.render(), e.value.render()
    assert time.monotonic() - started < 20  # far within COMMAND_WAIT (60 s)


def test_nodes_listed_twice_over_are_refused(tmp_path):
    with pytest.raises(ConfigError) as e:
        parse_cluster("nodes: [{host: a, gpus: 1}]\nnodes_command: echo b\n", str(tmp_path / "c.yaml"))
    assert e.value.key == "nodes" and "the nodes come from nodes_command" in e.value.render()
    with pytest.raises(ConfigError) as e:
        parse_cluster("nodes_command: true\n", str(tmp_path / "c.yaml"))
    assert "must be a command line that prints the nodes, got True" in e.value.render()


def test_the_list_read_again_is_run_again(tmp_path):
    pool = tmp_path / "pool.txt"
    pool.write_text("a slots=1\nb slots=1\n")
    config = parse_cluster(cluster_text(f"cat {pool}"), str(tmp_path / "c.yaml"))
    pool.write_text("b slots=1\nc slots=2\n")
    assert [(n.label, n.gpus) for n in relisted(config).nodes] == [("b", 1), ("c", 2)]


def printing(labels: str) -> str:
    """A program that prints these hosts, one a line."""
    return "printf '" + "\\n".join(labels.split()) + "\\n'"


def roster_of(labels: str, **top):
    config = parse_cluster(cluster_text(printing(labels), **top))
    return config, Roster.of(config)


def listed(config, labels: str):
    return parse_cluster(cluster_text(printing(labels))).nodes


def test_a_node_no_longer_listed_is_out_a_spare_takes_its_place_and_then_the_run_shrinks_as_min_nodes_allows():
    config, roster = roster_of("a b c d", spares=1, min_nodes=2)
    verdict = roster.relist(listed(config, "a c d"))
    assert verdict.go_on and verdict.notice == "b is no longer listed; spare d takes its place"
    assert [n.label for n in roster.cluster(config).nodes] == ["a", "d", "c"]
    verdict = roster.relist(listed(config, "c d"))
    assert verdict.go_on and verdict.notice == "a is no longer listed: 2 node(s) left"
    moved = roster.cluster(config)
    assert [n.label for n in moved.nodes] == ["d", "c"] and moved.master_addr == "d"  # node 0's gone: the master moves
    verdict = roster.relist(listed(config, "c"))
    assert not verdict.go_on and "fewer than min_nodes (2) are listed: no new attempt" in verdict.notice


def test_a_node_listed_for_the_first_time_joins_a_smaller_run_else_waits_as_a_spare():
    config, roster = roster_of("a b c", min_nodes=2)
    roster.relist(listed(config, "a c"))
    verdict = roster.relist(listed(config, "a c e f"))
    assert verdict.notice == "e is listed now: it joins the run, which grows to 3 node(s); f is listed now: it waits as a spare"
    assert [n.label for n in roster.cluster(config).nodes] == ["a", "c", "e"] and [n.label for n in roster.spares] == ["f"]
    roster.settle("c", lost=False)
    roster.settle("c", lost=False)  # the root cause twice: out for the rest of the run
    verdict = roster.relist(listed(config, "a c e f"))
    assert "c" in roster.quarantined and verdict.notice is None  # listed still, but out
    assert [n.label for n in roster.cluster(config).nodes] == ["a", "f", "e"]


def test_a_program_that_fails_before_an_attempt_leaves_the_last_good_list():
    config, _ = roster_of("a b", min_nodes=1)
    calls = []

    def lister(c):
        calls.append(c)
        if len(calls) == 1:
            raise ConfigError("c.yaml", 2, "nodes_command", "exited with status 1")
        if len(calls) == 2:
            raise UsageError("not a ConfigError, still the user's")
        return parse_cluster(cluster_text(printing("b c")))

    policy = Restarts.of(config, lister=lister)
    for _ in range(2):
        verdict = policy.relist()
        assert verdict.go_on and verdict.notice.endswith("; the run keeps its last good node list"), verdict.notice
        assert [n.label for n in policy.cluster().nodes] == ["a", "b"]
    assert policy.relist().notice == "a is no longer listed: 1 node(s) left; c is listed now: it joins the run, " \
                                     "which grows to 2 node(s)"
    assert [n.label for n in policy.cluster().nodes] == ["b", "c"] and policy.cluster().master_addr == "b"
    assert Restarts.of(config).relist().notice is None  # no nodes_command: nothing to read again



def test_a_node_newly_listed_while_a_smaller_run_runs_is_watched_and_joins_once_it_answers(tmp_path):
    """With `nodes_command:`, a smaller attempt is watched for nodes the program lists for the
    first time, as for away nodes: once one answers for rejoin_after, the run stops to take it."""
    import threading

    from orchestrator.job.events import Reshape
    from orchestrator.plan.launch import make_plan
    from orchestrator.run import regrow

    pool = tmp_path / "pool.txt"
    pool.write_text("a slots=1\nb slots=1\nc slots=1\n")
    config = parse_cluster(cluster_text(f"cat {pool}", min_nodes=2, rejoin_after=0), str(tmp_path / "c.yaml"))
    asked, done = [], threading.Event()
    policy = Restarts.of(config, planner=lambda c, a: make_plan(c, "train.py", [], "J1", "/tmp", attempt=a),
                         prober=lambda nodes: asked.append(sorted(n.label for n in nodes)) or {"d"},
                         lister=lambda c: relisted(c))
    pool.write_text("a slots=1\nb slots=1\n")
    assert policy.relist().notice == "c is no longer listed: 2 node(s) left"
    pool.write_text("a slots=1\nb slots=1\nd slots=1\n")
    real_every, regrow.ask_every = regrow.ask_every, lambda after: 0.01
    try:
        watch = policy.watch_away(lambda labels: (asked.append(labels), done.set()))
        assert watch is not None and done.wait(10)
    finally:
        regrow.ask_every = real_every
        policy.close()
    assert asked == [["d"], {"d"}]  # the new node, asked; then said to be ready
    plan, said, why = policy.reshape(Reshape("d answer(s) again", join=frozenset({"d"})), 1)
    assert why == "grown to 3 node(s): d joined"
    assert said == ["d is listed now: it joins the run, which grows to 3 node(s)"]
    assert [n.label for n in plan.nodes] == ["a", "b", "d"]


def test_a_jobs_record_of_its_nodes_stands_for_the_program(tmp_path):
    """A command about one detached job reaches the nodes the job recorded and never runs the
    program; one about every job adds what the program lists that is new, and goes on without a
    program that fails, saying so."""
    from orchestrator.config.clusterfile import Recorded
    from orchestrator.run.record import recorded_nodes, write_nodes

    path = str(tmp_path / "c.yaml")
    first = parse_cluster(cluster_text("printf 'a slots=2\\nb slots=2\\n'"), path)
    write_nodes(str(tmp_path / "runs" / "20260101-000000-abc123"), first.nodes)
    nodes = recorded_nodes(str(tmp_path / "runs"), ["20260101-000000-abc123", "../x", "20260101-000000-none00"])
    assert nodes == [{"host": "a", "gpus": 2}, {"host": "b", "gpus": 2}]
    marker = tmp_path / "ran"
    one = parse_cluster(cluster_text(f"touch {marker}; exit 1"), path, recorded=Recorded(nodes))
    assert [n.host for n in one.nodes] == ["a", "b"] and not marker.exists()
    said = []
    every = parse_cluster(cluster_text("exit 1"), path, recorded=Recorded(nodes, ask=True, note=said.append))
    assert [n.host for n in every.nodes] == ["a", "b"] and "exited with status 1" in said[0]
    grown = parse_cluster(cluster_text("printf 'c slots=1\\nb slots=2\\n'"), path, recorded=Recorded(nodes, ask=True))
    assert [n.host for n in grown.nodes] == ["a", "b", "c"]
    assert recorded_nodes(str(tmp_path / "runs"), ["20260101-000000-none00"]) is None
