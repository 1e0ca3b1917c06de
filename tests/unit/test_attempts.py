"""Restarts and spares: who runs the next attempt, and how long the run waits for it."""

from __future__ import annotations

import signal

from orchestrator.attempts import Restarts, Roster, delay_before, vetted_after, wait_for_signal
from orchestrator.clusterfile import parse_cluster
from orchestrator.signals import SignalInbox


def cluster(n: int, **top) -> object:
    head = "".join(f"{k}: {v}\n" for k, v in top.items())
    return parse_cluster(head + "nodes:\n" + "".join(f"  - {{host: h{i}, gpus: 2}}\n" for i in range(n)))


def test_spares_wait_and_the_job_starts_on_the_others():
    config = cluster(4, spares=1)
    first = Roster.of(config).cluster(config)
    assert [n.label for n in first.nodes] == ["h0", "h1", "h2"] and first.master_addr == "h0"
    assert [n.rank for n in first.nodes] == [0, 1, 2]


def test_a_lost_node_is_out_at_once_and_the_spare_takes_its_rank():
    config = cluster(4, spares=1)
    roster = Roster.of(config)
    verdict = roster.settle("h1", lost=True)
    assert verdict.go_on and verdict.notice == "h1 is out for the rest of the run (lost); spare h3 takes its place as node 1"
    nxt = roster.cluster(config)
    assert [(n.rank, n.label, n.gpus) for n in nxt.nodes] == [(0, "h0", 2), (1, "h3", 2), (2, "h2", 2)]


def test_a_failing_node_gets_a_second_chance_then_is_out():
    roster = Roster.of(cluster(3, spares=1))
    assert roster.settle("h0", lost=False).notice is None and roster.quarantined == []
    verdict = roster.settle("h0", lost=False)
    assert roster.quarantined == ["h0"] and "(the root cause twice)" in verdict.notice


def test_the_master_moves_only_when_its_node_is_out():
    config = cluster(3, spares=1)
    roster = Roster.of(config)
    roster.settle("h1", lost=True)
    assert roster.cluster(config).master_addr == "h0"
    config = cluster(3, spares=1)
    roster = Roster.of(config)
    roster.settle("h0", lost=True)
    assert roster.cluster(config).master_addr == "h2" and roster.cluster(config).nodes[0].label == "h2"


def test_without_a_spare_the_run_shrinks_only_as_far_as_min_nodes_allows():
    config = cluster(3, min_nodes=2)
    roster = Roster.of(config)
    verdict = roster.settle("h2", lost=True)
    assert verdict.go_on and "going on with 2 node(s) (min_nodes: 2), a smaller world" in verdict.notice
    assert [n.label for n in roster.cluster(config).nodes] == ["h0", "h1"]
    verdict = roster.settle("h1", lost=True)
    assert not verdict.go_on and "no spare is left" in verdict.notice


def test_restarts_stop_when_none_are_left():
    policy = Restarts.of(cluster(2, restarts=1))
    assert policy.after(0, ("h0", False))[0] is not None
    assert policy.after(1, ("h0", False)) == (None, None)
    assert Restarts.of(cluster(2, restarts=5), limit=0).after(0, (None, False)) == (None, None)


def test_each_restart_waits_longer():
    assert [delay_before(a, 10) for a in (1, 2, 3)] == [10, 20, 30]


def test_a_signal_ends_the_wait_at_once_and_stops_the_run():
    inbox = SignalInbox()
    inbox._record(signal.SIGINT, None)  # as the kernel would call it
    assert wait_for_signal(inbox, 3600) == signal.SIGINT
    assert wait_for_signal(SignalInbox(), 0.01) is None


def test_without_spares_or_min_nodes_every_attempt_runs_on_the_nodes_listed():
    config = cluster(2, restarts=3)
    roster = Roster.of(config)
    for _ in range(3):
        assert roster.settle("h1", lost=True).notice is None
    assert roster.quarantined == [] and [n.label for n in roster.cluster(config).nodes] == ["h0", "h1"]


def test_a_later_attempt_preflights_again_only_a_node_that_was_lost_or_is_new():
    from orchestrator.outcome import NodeStatus
    from orchestrator.plan import make_plan

    plan = make_plan(cluster(3), "train.py", [], "J1", "/tmp")
    statuses = [NodeStatus(n, state=state, info=info) for n, (state, info) in zip(plan.nodes, [
        ("failed", {"torch": "2.13.0", "cuda": "12.1", "nccl": "2.20.5", "gpus": 2}),
        ("lost", {"torch": "2.13.0"}),
        ("connecting", {})])]
    vetted = vetted_after({"h2": {"torch": "2.13.0"}, "h1": {"torch": "2.13.0"}}, statuses)
    assert vetted == {"h0": {"torch": "2.13.0", "cuda": "12.1", "nccl": "2.20.5"}, "h2": {"torch": "2.13.0"}}
    policy = Restarts.of(cluster(3, restarts=1), planner=lambda c, a: make_plan(c, "train.py", [], "J1", "/tmp", attempt=a))
    policy.vet(statuses)
    nxt = policy.plan(policy.first_cluster(), 1)
    assert [nxt.agent_spec(n).needs_torch for n in nxt.nodes] == [False, True, True]


def test_an_exit_code_a_restart_cannot_fix_ends_the_run_at_once():
    """Issue 27, item 5: `no_restart_on_exit: [2]` with restarts left: a root cause that exited 2
    (a usage error: the same again) is not started again; another code is."""
    from orchestrator.outcome import Failure, JobResult
    policy = Restarts.of(cluster(2, restarts=3, no_restart_on_exit="[2, 64]"))
    failed = lambda code: JobResult(None, (), None, (Failure(1, "h1", 3, code, f"rank 3 exited with code {code}",  # noqa: E731
                                                             1.0),))
    assert policy.unfixable(failed(2)) == "h1 rank 3 exited with 2, which no_restart_on_exit lists: no restart"
    assert policy.unfixable(failed(1)) is None and policy.unfixable(JobResult(None, (), None, ())) is None
    import pytest

    from orchestrator.errors import ConfigError
    with pytest.raises(ConfigError, match=r"no_restart_on_exit: must be a list of exit codes from 1 to 255"):
        cluster(2, no_restart_on_exit="[0, 300]")
