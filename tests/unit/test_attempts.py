"""Restarts and spares: who runs the next attempt, and how long the run waits for it."""

from __future__ import annotations

import signal
import threading
import time

from orchestrator.run.attempts import Restarts, delay_before, vetted_after, wait_for_signal
from orchestrator.run.roster import Roster
from orchestrator.config.clusterfile import parse_cluster
from orchestrator.remote.signals import SignalInbox


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
    assert verdict.go_on and verdict.notice == "h1 is out until it answers again (lost); spare h3 takes its place as node 1"
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


def test_a_node_lost_twice_is_out_for_the_rest_of_the_run_and_never_asked_again():
    config = cluster(4, min_nodes=2)
    roster = Roster.of(config)
    roster.settle("h1", lost=True)
    assert roster.rejoin({"h1"}, config.nodes) and [n.label for n in roster.active] == ["h0", "h1", "h2", "h3"]
    verdict = roster.settle("h1", lost=True)
    assert verdict.notice.startswith("h1 is out for the rest of the run (lost twice); no spare left: going on with 3")
    assert roster.quarantined == ["h1"] and roster.away == [] and roster.rejoin({"h1"}, config.nodes) == []
    assert "h1" not in [n.label for n in roster.active]


def test_a_lost_node_that_answers_again_rejoins_in_its_place_and_the_world_grows_back():
    config = cluster(4, min_nodes=2)
    roster = Roster.of(config)
    roster.settle("h0", lost=True)
    roster.settle("h2", lost=True)
    shrunk = roster.cluster(config)
    assert [n.label for n in shrunk.nodes] == ["h1", "h3"] and shrunk.master_addr == "h1" and roster.out == ("h0", "h2")
    assert roster.rejoin({"h2"}, config.nodes) == ["h2 answers again: it rejoins the run, which grows back to 3 node(s)"]
    assert [(n.rank, n.label) for n in roster.cluster(config).nodes] == [(0, "h1"), (1, "h2"), (2, "h3")]
    assert roster.rejoin(set(), config.nodes) == [] and roster.out == ("h0",)  # still away: asked again next time
    roster.rejoin({"h0"}, config.nodes)
    grown = roster.cluster(config)
    assert [n.label for n in grown.nodes] == ["h0", "h1", "h2", "h3"] and grown.master_addr == "h0" and roster.out == ()


def test_a_lost_node_that_answers_again_after_a_spare_took_its_place_waits_as_a_spare():
    config = cluster(3, spares=1)
    roster = Roster.of(config)
    roster.settle("h1", lost=True)
    assert roster.rejoin({"h1"}, config.nodes) == ["h1 answers again: it waits as a spare"]
    assert [n.label for n in roster.active] == ["h0", "h2"] and [n.label for n in roster.spares] == ["h1"]
    verdict = roster.settle("h0", lost=True)  # the next loss: the node back takes its place
    assert verdict.notice == "h0 is out until it answers again (lost); spare h1 takes its place as node 0"


def test_a_restart_asks_the_nodes_away_meanwhile_and_takes_back_those_that_answer():
    from orchestrator.plan.launch import make_plan

    asked = []
    policy = Restarts.of(cluster(3, restarts=2, min_nodes=2),
                         planner=lambda c, a: make_plan(c, "train.py", [], "J1", "/tmp", attempt=a),
                         prober=lambda nodes: asked.append([n.label for n in nodes]) or {"h2"})
    assert policy.ask_away() is None and asked == []  # no one away: no one asked
    policy.roster.settle("h2", lost=True)
    assert policy.ask_away() is None and asked == []  # lost a moment ago: the smaller run starts at once
    policy.roster.settle("h0", lost=False)  # the next attempt failed: the restart after asks h2
    asking = policy.ask_away()
    assert asking.done.wait(10) and asked == [["h2"]]
    assert policy.welcome(asking) == ["h2 answers again: it rejoins the run, which grows back to 3 node(s)"]
    plan = policy.plan(policy.cluster(), 2)
    assert [n.label for n in plan.nodes] == ["h0", "h1", "h2"] and plan.quarantined == ()
    failing = Restarts.of(cluster(3, restarts=2, min_nodes=2), prober=lambda nodes: 1 / 0)
    failing.roster.settle("h2", lost=True)
    failing.roster.settle(None, lost=False)
    asking = failing.ask_away()
    assert asking.done.wait(10) and failing.welcome(asking) == [] and failing.roster.out == ("h2",)


def failed(kind="own", code=7, exception=None, label="h1", at=1.0):
    from orchestrator.diagnose.outcome import Failure, JobResult
    return JobResult(None, (), None, (Failure(1, label, 3, code, f"rank 3 exited with code {code}", at,
                                              exception, kind=kind),))


def record(number, result, took=5.0, start=100.0):
    from orchestrator.run.attempts import AttemptRecord, attempt_end, failure_signature
    return AttemptRecord(number, start, start + took, ("h0", "h1"), 4, result.exit_code, "x",
                         attempt_end(result, ("h1", False)), failure_signature(result))


def test_restarts_stop_when_none_are_left():
    policy = Restarts.of(cluster(2, restarts=1))
    first = policy.after(failed(), [record(0, failed())], ("h1", False))
    assert first.cluster is not None and first.why == "restart 1 of 1"
    assert policy.after(failed(), [record(1, failed())], ("h1", False)).why == "no restart left (restarts: 1)"
    none = Restarts.of(cluster(2, restarts=5), limit=0)
    assert not none.any and none.after(failed(), [record(0, failed())], ("h1", False)).cluster is None


def test_a_lost_node_or_an_outside_stop_uses_up_recoveries_not_restarts():
    """Issue 27, item 5: a node lost, or Slurm's preemption, is not one of the job's own failures."""
    policy = Restarts.of(cluster(2, restarts=1))
    assert policy.recoveries == 3  # the default where the run restarts at all
    for n, kind in enumerate(("lost", "outside", "lost")):
        nxt = policy.after(failed(kind), [record(n, failed(kind))], ("h1", kind == "lost"))
        assert nxt.cluster is not None and nxt.why.startswith(f"recovery {n + 1} of 3 (not the job's own failure")
    assert policy.after(failed("lost"), [record(3, failed("lost"))], ("h1", True)).why == \
        "no recovery left (recoveries: 3)"
    assert policy.after(failed(), [record(4, failed())], ("h1", False)).why == "restart 1 of 1"  # untouched
    assert Restarts.of(cluster(2)).recoveries == 0 and not Restarts.of(cluster(2)).any  # nobody asked for restarts
    assert Restarts.of(cluster(3, spares=1)).recoveries == 3 and Restarts.of(cluster(2, recoveries=0)).recoveries == 0


def test_why_an_attempt_ended_tells_the_jobs_failures_from_the_rest():
    from dataclasses import replace

    from orchestrator.run.attempts import attempt_end
    assert [attempt_end(failed(kind), ("h1", False)) for kind in ("own", "hung", "lost", "outside")] == \
        ["failed", "hung", "lost", "stopped from outside"]
    assert attempt_end(replace(failed(), interrupted=signal.SIGTERM), ("h1", False)) == "stopped"
    assert attempt_end(failed(), ("h1", True), could_not_start=True) == "could not start"


def test_a_crash_loop_stops_restarting_before_restarts_run_out():
    """Three attempts in a row failing the same way (numbers aside), none getting much further."""
    from orchestrator.run.attempts import crash_loop
    oom = [failed(exception=f"RuntimeError: CUDA out of memory. Tried to allocate {gib} GiB") for gib in (2, 3, 2)]
    records = [record(n, r, took=t) for n, (r, t) in enumerate(zip(oom, (30.0, 34.0, 29.0)))]
    assert crash_loop(records[:2]) is None  # twice is not a loop: a job may well fail twice, then run
    assert crash_loop(records).startswith("crash loop: attempts 0 to 2 failed the same way, each within 34 s")
    policy = Restarts.of(cluster(2, restarts=10))
    assert policy.after(oom[2], records, ("h1", False)).cluster is None
    got_further = records[:2] + [record(2, oom[2], took=600.0)]
    assert crash_loop(got_further) is None
    other = records[:2] + [record(2, failed(code=3))]
    assert crash_loop(other) is None
    lost = [record(n, failed("lost")) for n in range(3)]
    assert crash_loop(lost) is None  # a lost node is not the job failing


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
    from orchestrator.diagnose.outcome import NodeStatus
    from orchestrator.plan.launch import make_plan

    plan = make_plan(cluster(3), "train.py", [], "J1", "/tmp")
    statuses = [NodeStatus(n, state=state, info=info) for n, (state, info) in zip(plan.nodes, [
        ("failed", {"torch": "2.13.0", "cuda": "12.1", "nccl": "2.20.5", "gpus": 2}),
        ("lost", {"torch": "2.13.0"}),
        ("connecting", {})])]
    vetted = vetted_after({"h2": {"torch": "2.13.0"}, "h1": {"torch": "2.13.0"}}, statuses)
    assert vetted == {"h0": {"torch": "2.13.0", "cuda": "12.1", "nccl": "2.20.5"}, "h2": {"torch": "2.13.0"}}
    policy = Restarts.of(cluster(3, restarts=1), planner=lambda c, a: make_plan(c, "train.py", [], "J1", "/tmp", attempt=a))
    policy.vet(statuses)
    nxt = policy.plan(policy.cluster(), 1)
    assert [nxt.agent_spec(n).needs_torch for n in nxt.nodes] == [False, True, True]


def test_an_exit_code_a_restart_cannot_fix_ends_the_run_at_once():
    """Issue 27, item 5: `no_restart_on_exit: [2]` with restarts left: a root cause that exited 2
    (a usage error: the same again) is not started again; another code is."""
    from orchestrator.diagnose.outcome import JobResult
    policy = Restarts.of(cluster(2, restarts=3, no_restart_on_exit="[2, 64]"))
    assert policy.unfixable(failed(code=2)) == "h1 rank 3 exited with 2, which no_restart_on_exit lists: no restart"
    assert policy.unfixable(failed(code=1)) is None and policy.unfixable(JobResult(None, (), None, ())) is None
    assert policy.unfixable(failed("outside", code=2)) is None  # Slurm's stop is no exit code of the job's
    assert policy.after(failed(code=2), [], ("h1", False)).why == policy.unfixable(failed(code=2))
    import pytest

    from orchestrator.errors import ConfigError
    with pytest.raises(ConfigError, match=r"no_restart_on_exit: must be a list of exit codes from 1 to 255"):
        cluster(2, no_restart_on_exit="[0, 300]")


def test_no_attempt_follows_a_stop_that_slurm_made():
    """Slurm's time limit or preemption ends the allocation: recovering inside it would only
    fail to start; Slurm's requeue is what starts the job again."""
    from dataclasses import replace

    slurm = failed("outside")
    slurm = replace(slurm, failures=(replace(slurm.failures[0], what="Slurm cancelled step 4.1 due to time limit"),))
    policy = Restarts.of(cluster(2, restarts=3))
    assert policy.after(slurm, [record(0, slurm)], ("h1", False)).why.startswith("Slurm is ending the allocation")
    assert policy.after(failed("outside"), [record(0, failed("outside"))], ("h1", False)).cluster is not None


# --- growing back while an attempt runs ------------------------------------------------------------

def test_a_node_counts_as_back_once_it_has_answered_for_rejoin_after_without_a_miss():
    from orchestrator.run.regrow import Streaks, ask_every
    streaks = Streaks(rejoin_after=60.0)
    assert streaks.heard(0.0, ["h1", "h2"], {"h1"}) == set()
    assert streaks.heard(30.0, ["h1", "h2"], {"h1", "h2"}) == set()
    assert streaks.heard(45.0, ["h1", "h2"], {"h2"}) == set()  # h1 missed: it starts over
    assert streaks.heard(90.0, ["h1", "h2"], {"h1", "h2"}) == {"h2"}  # h2: 60 s since 30.0, no miss
    assert Streaks(0.0).heard(5.0, ["h1"], {"h1"}) == {"h1"}
    assert [ask_every(s) for s in (0, 20, 600, 86400)] == [2.0, 5.0, 60.0, 60.0]


def test_the_watch_asks_the_away_nodes_until_they_have_answered_long_enough_then_says_so_once():
    import threading
    from orchestrator.run.regrow import Watch
    config = cluster(3)
    asked, said, answers = [], [], iter([set(), {"h2"}, {"h2"}, {"h2"}, {"h2"}])
    done, now = threading.Event(), [0.0]

    def prober(nodes):  # each ask takes a second
        asked.append([n.label for n in nodes])
        now[0] += 1.0
        return next(answers)

    watch = Watch(prober, lambda: [config.nodes[2]], 2.0, lambda labels: (said.append(labels), done.set()),
                  clock=lambda: ticking(now), every=0.001)
    assert done.wait(10)
    watch.join()
    assert said == [{"h2"}] and asked == [["h2"]] * 4  # a miss, then answers at 2, 3, 4: 2 s without a miss
    failing = Watch(lambda nodes: 1 / 0, lambda: [config.nodes[2]], 0.0, said.append, every=0.001)
    assert not failing.closed.wait(0.05)  # a prober that fails finds no one, and the watch goes on
    failing.join()
    assert said == [{"h2"}] and not failing.thread.is_alive()


def ticking(now: list) -> float:
    """A fake clock that the asks move on (by their length), and each reading a little (as time
    goes on between them)."""
    now[0] += 0.001
    return now[0]


def test_rejoin_after_is_counted_from_when_a_node_answered_not_from_when_the_ask_began():
    """An ask begun while the link was down, that the link's return let through 4 s later: the
    node has answered since then, not since the ask began (taken back 3.6 s early, once)."""
    from orchestrator.run.regrow import Watch
    config = cluster(3)
    now, asks, done, said = [0.0], [], threading.Event(), []

    def prober(nodes):
        asks.append(now[0])
        now[0] += 4.0 if len(asks) == 1 else 2.0  # the first ask waits out the cut; then 2 s each
        return {"h2"}

    watch = Watch(prober, lambda: [config.nodes[2]], 5.0, lambda labels: (said.append(labels), done.set()),
                  clock=lambda: ticking(now), every=0.001)
    assert done.wait(10)
    watch.join()
    assert said == [{"h2"}] and [round(t) for t in asks] == [0, 4, 6, 8]  # answered at 4, then 6, 8, 10: 6 s since 4


def test_a_running_attempt_is_watched_only_while_it_is_smaller_than_the_run_started_and_rejoin_after_allows():
    answers = lambda nodes: set()  # noqa: E731
    policy = Restarts.of(cluster(3, min_nodes=2), prober=answers)
    assert policy.watch_away(print) is None  # no one away
    policy.roster.settle("h2", lost=True)
    watch = policy.watch_away(print)
    assert watch is not None and watch.every == 60.0  # rejoin_after: 10m by default: an ask a minute
    watch.join()
    never = Restarts.of(cluster(3, min_nodes=2, rejoin_after="never"), prober=answers)
    never.roster.settle("h2", lost=True)
    assert never.watch_away(print) is None
    spare = Restarts.of(cluster(4, spares=1), prober=answers)
    spare.roster.settle("h1", lost=True)  # the spare took its place: the run is whole, nothing to grow back to
    assert spare.roster.away and spare.watch_away(print) is None


def test_an_attempt_stopped_to_grow_is_followed_at_once_by_one_with_the_node_back_on_no_budget():
    from orchestrator.job.events import Reshape
    from orchestrator.plan.launch import make_plan
    from orchestrator.run.attempts import attempt_end
    policy = Restarts.of(cluster(3, min_nodes=2, restarts=1),
                         planner=lambda c, a: make_plan(c, "train.py", [], "J1", "/tmp", attempt=a))
    policy.roster.settle("h0", lost=True)  # the master's node: the master moved to h1
    assert policy.cluster().master_addr == "h1"
    GROW = Reshape("h0 answer(s) again", join=frozenset({"h0"}))
    assert attempt_end(failed(), ("h1", False), reshape=GROW) == "failed"  # a rank failed by itself meanwhile
    assert attempt_end(failed("lost"), ("h1", True), reshape=GROW) == "lost"
    plan, said, why = policy.reshape(GROW, 2)
    assert why == "grown back to 3 node(s): h0 rejoined"
    assert said == ["h0 answers again: it rejoins the run, which grows back to 3 node(s)"]
    assert [n.label for n in plan.nodes] == ["h0", "h1", "h2"] and plan.world_size == 6 and plan.master_addr == "h0"
    assert plan.attempt == 2 and not policy.used and plan.quarantined == ()


def test_a_grow_cut_short_by_another_node_lost_still_takes_back_the_node_that_answered():
    """h2 was lost and answered again; in the grow's stop h1 is lost too. Without h2 back, one node
    would be left, under min_nodes: the run would end. It takes h2 back first, then leaves h1 out."""
    from dataclasses import replace

    from orchestrator.diagnose.outcome import NodeOutcome
    from orchestrator.job.events import Reshape
    from orchestrator.plan.launch import make_plan
    policy = Restarts.of(cluster(3, min_nodes=2, recoveries=2))
    policy.roster.settle("h2", lost=True)
    lost = failed("lost", code=None)
    alone = Restarts.of(cluster(3, min_nodes=2, recoveries=2))  # as before: the grow's node forgotten
    alone.roster.settle("h2", lost=True)
    assert alone.after(lost, [record(1, lost)], ("h1", True)).cluster is None
    assert policy.welcome_asked(None, lost) == [] and policy.welcome_asked(Reshape("a stop"), lost) == []
    plan = make_plan(cluster(3), "train.py", [], "J1", "/tmp")
    h1_lost = replace(lost, nodes=(NodeOutcome(plan.nodes[1], "lost", None, None, "no heartbeat", 3),))
    said = policy.welcome_asked(Reshape("h2 answer(s) again", join=frozenset({"h2"})), h1_lost)
    assert said == ["h2 answers again: it rejoins the run, which goes on with 2 node(s)"]  # h1 leaves: not "grows back to 3"
    nxt = policy.after(lost, [record(1, lost)], ("h1", True))
    assert nxt.cluster is not None and [n.label for n in nxt.cluster.nodes] == ["h0", "h2"], nxt


def test_a_node_lost_with_no_failure_of_its_own_is_the_root_cause_with_why():
    """A replayed attempt whose node the attach lost, where no journal or supervisor named a
    failure: the record says which node and why, not the bare "h1 lost"."""
    from orchestrator.diagnose.outcome import JobResult, NodeOutcome
    from orchestrator.plan.launch import make_plan
    from orchestrator.run.attempts import attempt_record, blame
    plan = make_plan(cluster(2), "train.py", [], "J1", "/tmp")
    nodes = (NodeOutcome(plan.nodes[0], "stopped", 143, None, None, 3),
             NodeOutcome(plan.nodes[1], "lost", None, None, "no heartbeat from the node for 3 s", 3))
    result = JobResult(plan, nodes, None, ())
    assert blame(result) == ("h1", True)
    assert attempt_record(plan, result, 0.0, blame(result)).root_cause == "h1 lost (no heartbeat from the node for 3 s)"


def test_a_straggler_is_set_aside_only_where_the_run_can_do_without_it_and_a_second_time_for_good():
    from orchestrator.job.events import Reshape
    from orchestrator.plan.launch import make_plan

    def planned(**top):
        return Restarts.of(cluster(3, evict_after="15m", **top),
                           planner=lambda c, a: make_plan(c, "train.py", [], "J1", "/tmp", attempt=a))

    assert planned(spares=1).plan(planned(spares=1).cluster(), 0).evict_after == 900.0
    policy = planned(min_nodes=2)
    assert policy.plan(policy.cluster(), 0).evict_after == 900.0
    plan, said, why = policy.reshape(Reshape("h1 straggles", aside="h1"), 1)
    assert why == "h1 set aside: 2 node(s)"
    assert said == ["h1 is out until it answers again (set aside: a straggler); no spare left: going on with 2 node(s) "
                    "(min_nodes: 2), a smaller world"]
    assert [n.label for n in plan.nodes] == ["h0", "h2"] and not policy.used
    assert plan.evict_after is None  # at min_nodes now: every node needed, a straggler is only named
    policy.roster.rejoin({"h1"}, policy.config.nodes)
    assert policy.roster.set_aside("h1").notice.startswith("h1 is out for the rest of the run (set aside after it was "
                                                           "out once already)")


def test_evict_after_without_a_node_to_spare_is_refused_naming_the_fix():
    import pytest

    from orchestrator.errors import ConfigError
    with pytest.raises(ConfigError) as e:
        parse_cluster("nodes: [{host: a, gpus: 1}, {host: b, gpus: 1}]\nevict_after: 15m\nmin_nodes: 2\n")
    assert e.value.key == "evict_after" and "add `spares: 1`, or `min_nodes:` below the node count" in e.value.message
    assert parse_cluster("nodes: [{host: a, gpus: 1}, {host: b, gpus: 1}]\nevict_after: 15m\nmin_nodes: 1\n").evict_after == 900




def test_a_watch_closed_cuts_its_ask_short_and_the_run_waits_for_no_dead_host(monkeypatch):
    """The attempt ends while an ask is under way to a node that does not answer (a connect that
    would take its whole timeout): closing the watch cuts that ask short (detect.Answering.cut
    closes the calls under way: an ssh client still connecting is ended), and the run's end
    waits for nothing."""
    import threading
    import time as clock

    from orchestrator.remote.oneshot import Calls
    from orchestrator.run import regrow

    asking = threading.Event()

    class Call:  # an AgentCall still connecting: abort() is what ends it
        def __init__(self):
            self.closed = threading.Event()

        def abort(self):
            self.closed.set()

    class Stuck:
        def __init__(self):
            self.calls = Calls()

        def __call__(self, nodes):
            call = Call()
            self.calls.add(call)
            asking.set()
            call.closed.wait(60)  # as a connect to a dead host would, until its call is closed
            self.calls.discard(call)
            return set()

        def cut(self):
            self.calls.cut()

    monkeypatch.setattr(regrow, "ask_every", lambda after: 0.01)
    policy = Restarts.of(cluster(3, min_nodes=2), prober=Stuck())
    policy.roster.settle("h2", lost=True)
    watch = policy.watch_away(print)
    assert asking.wait(10)
    started = clock.monotonic()
    watch.close()
    policy.close()
    assert not watch.thread.is_alive() and clock.monotonic() - started < 5


def test_an_ask_whose_node_never_reads_is_cut_short_with_everything_it_started(tmp_path):
    """A real ask (detect.Answering) to a node whose agent never starts reading: its `setup:`
    sleeps, so the agent's code fills the pipe and the call's writer blocks on it. Cut, the ask
    returns at once, nothing it started goes on, and the node counts as not answering."""
    import subprocess
    import threading
    import time as clock

    from orchestrator.remote.detect import Answering

    marker = f"{tmp_path}/never-reads"
    node = parse_cluster(f"transport: local\nsetup: 'sleep 60 # {marker}'\nnodes: [{{host: h0, gpus: 1}}]\n").nodes[0]
    answering, found = Answering(), []
    thread = threading.Thread(target=lambda: found.append(answering([node])), daemon=True)
    thread.start()

    def running() -> list[str]:
        return subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()

    deadline = clock.monotonic() + 30
    while not running() and clock.monotonic() < deadline:
        clock.sleep(0.05)
    assert running(), "the ask never started"
    started = clock.monotonic()
    answering.cut()  # not held by the call's writer, blocked on the pipe: its setup sleeps 60 s
    thread.join(10)
    assert clock.monotonic() - started < 10 and not thread.is_alive() and found == [set()]
    deadline = clock.monotonic() + 10
    while running() and clock.monotonic() < deadline:
        clock.sleep(0.05)
    assert not running()


def test_a_lost_nodes_unconfirmed_cleanup_is_said_as_past_once_it_ran_a_later_attempt():
    """The end of an elastic run whose lost node came back: the sweep that could not reach it then
    is not told as if the node were still unreachable and its processes maybe running."""
    from types import SimpleNamespace

    from orchestrator.remote.cleanup import SweepReport, sweep_notices

    reports = [SweepReport(SimpleNamespace(label=label), error="ssh: connect timed out") for label in ("a", "b")]
    assert sweep_notices(reports, 30, frozenset({"b"})) == [
        "a: cleanup not confirmed (ssh: connect timed out); its agent stops the job by itself within orphan_timeout "
        "(30 s), or run ddp-kill",
        "b: when it was lost, its cleanup could not be confirmed (ssh: connect timed out); it answered again "
        "afterwards, and ran a later attempt"]


def test_every_node_lost_in_an_attempt_is_out_of_the_next_whatever_the_root_cause():
    config = cluster(3, min_nodes=1)
    roster = Roster.of(config)
    verdict = roster.settle("h1", lost=True, also_lost=("h1", "h2"))  # two links cut together
    assert verdict.go_on and [n.label for n in roster.cluster(config).nodes] == ["h0"]
    assert roster.out == ("h1", "h2") and "h1 is out" in verdict.notice and "h2 is out" in verdict.notice
    config = cluster(3, min_nodes=2, restarts=1)
    roster = Roster.of(config)
    verdict = roster.settle("h0", lost=False, also_lost=("h2",))  # a rank failed on h0 as h2 dropped
    assert verdict.go_on and [n.label for n in roster.cluster(config).nodes] == ["h0", "h1"] and roster.out == ("h2",)
    assert roster.quarantined == []  # h0 failed once: a second chance


def test_a_loss_below_min_nodes_says_so_and_never_advises_what_is_set():
    config = cluster(3, min_nodes=2)
    verdict = Roster.of(config).settle("h1", lost=True, also_lost=("h1", "h2"))
    assert not verdict.go_on and "fewer than min_nodes (2)" in verdict.notice and "set `" not in verdict.notice
    verdict = Roster.of(cluster(4, spares=1)).settle("h1", lost=True, also_lost=("h1", "h2"))
    assert not verdict.go_on and "spare h3 takes its place as node 1" in verdict.notice  # then h2: no spare left
    assert "h2 is out until it answers again (lost), and no spare is left (set `spares:`" in verdict.notice


def test_without_spares_or_min_nodes_a_lost_node_stays_listed():
    config = cluster(3, restarts=1)
    roster = Roster.of(config)
    assert roster.settle("h0", lost=False, also_lost=("h2",)).go_on and len(roster.cluster(config).nodes) == 3


def test_the_next_attempt_is_planned_without_every_node_the_last_one_lost():
    from orchestrator.diagnose.outcome import Failure, JobResult, NodeOutcome

    nodes = cluster(3, min_nodes=1, restarts=1).nodes
    outcomes = tuple(NodeOutcome(type("P", (), {"label": n.label})(), s, None, None, None, 0)
                     for n, s in zip(nodes, ("failed", "lost", "lost")))
    result = JobResult(None, outcomes, None, (Failure(0, "h0", 0, 1, "rank 0 exited with code 1", 1.0, None),))
    policy = Restarts.of(cluster(3, min_nodes=1, restarts=1))
    nxt = policy.after(result, [record(0, result)], ("h0", False))
    assert nxt.cluster is not None and [n.label for n in nxt.cluster.nodes] == ["h0"]


def test_dead_candidates_never_hold_up_a_live_one():
    """A node back beside 200 newly listed hosts that never answer: each is asked on its own clock,
    at most ASK_AT_ONCE at once, a silent one less often after each miss: the live one is taken
    back after rejoin_after, as alone (one ask of every candidate together once outlasted it)."""
    from orchestrator.config.clusterfile import parse_cluster
    from orchestrator.run import regrow

    nodes = parse_cluster("nodes:\n  - {host: live, gpus: 1}\n" +  # an away node: candidates() gives those first
                          "".join(f"  - {{host: d{i}, gpus: 1}}\n" for i in range(200))).nodes
    started, under_way, most, lock, done = time.monotonic(), [0], [0], threading.Lock(), threading.Event()

    def prober(asked):
        with lock:
            under_way[0] += 1
            most[0] = max(most[0], under_way[0])
        try:
            if asked[0].label == "live":
                return {"live"}
            time.sleep(0.2)  # a dead host: its connect timeout
            return set()
        finally:
            with lock:
                under_way[0] -= 1

    said = []
    watch = regrow.Watch(prober, lambda: list(nodes), 0.3, lambda labels: (said.append(labels), done.set()),
                         every=0.05)
    assert done.wait(10)
    watch.join()
    assert said == [{"live"}] and most[0] <= regrow.ASK_AT_ONCE and time.monotonic() - started < 5


STORE_TAKEN = ("torch.distributed.DistNetworkError: The server socket has failed to listen on any local network "
               "address. port: 24293, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use")


def launcher_failed(exception):
    from orchestrator.diagnose.outcome import Failure, JobResult
    return JobResult(None, (), None, (Failure(0, "h0", None, 1, "launcher exited with code 1", 1.0, exception),))


def test_a_master_port_taken_before_the_launchers_bind_is_tried_again_at_once_on_no_budget():
    """Another program took the port between its check and torchrun's store: the same nodes again,
    on a fresh port, at once, with no restart set; three times a run, then it is the failure it is."""
    policy = Restarts.of(cluster(2))
    assert not policy.any and policy.follows(launcher_failed(STORE_TAKEN))
    for n in range(3):
        nxt = policy.after(launcher_failed(STORE_TAKEN), [record(n, launcher_failed(STORE_TAKEN))], ("h0", False))
        assert nxt.at_once and [node.label for node in nxt.cluster.nodes] == ["h0", "h1"], nxt
        assert nxt.why.startswith(f"the master port was taken before the launcher could listen on it: again on "
                                  f"another port ({n + 1} of 3; restarts: untouched)")
    assert not policy.follows(launcher_failed(STORE_TAKEN))
    assert policy.after(launcher_failed(STORE_TAKEN), [record(3, launcher_failed(STORE_TAKEN))],
                        ("h0", False)).cluster is None
    assert policy.roster.blamed == {}  # no node's fault
    # a rank's own EADDRINUSE (a port of the script's), and the launcher's other failures, are failures
    assert not Restarts.of(cluster(2)).follows(failed(exception="OSError: [Errno 98] EADDRINUSE"))
    assert not Restarts.of(cluster(2)).follows(launcher_failed("torch.distributed.DistStoreError: timed out"))


def test_an_away_node_that_answers_but_cannot_run_is_named_once_with_its_fix():
    """A node back with its python gone answers (its shell ran) but cannot rejoin: the run, which
    goes on smaller, says why, once a problem, at the restart and at its end."""
    from orchestrator.errors import NodeProblem

    class Prober:
        unfit = {}

        def __call__(self, nodes):
            self.unfit["h2"] = NodeProblem("h2", "python not found: '/venv/bin/python' (command not found)",
                                           "set `python:` to the interpreter's absolute path on that node")
            return set()

    policy = Restarts.of(cluster(3, restarts=2, min_nodes=2), prober=Prober())
    policy.roster.settle("h2", lost=True)
    policy.roster.settle(None, lost=False)
    asking = policy.ask_away()
    assert asking.done.wait(10)
    assert policy.welcome(asking) == ["h2 answers again but cannot rejoin: python not found: '/venv/bin/python' "
                                      "(command not found) (fix: set `python:` to the interpreter's absolute path "
                                      "on that node)"]
    assert policy.unfit() == [] and policy.roster.out == ("h2",)  # said once


def test_a_reply_says_whether_the_node_ran_the_agent_or_was_never_reached():
    from orchestrator.config.clusterfile import parse_cluster
    from orchestrator.node.protocol import wire
    from orchestrator.remote.oneshot import call_agent

    broken = parse_cluster("transport: local\nsetup: ['false']\nnodes:\n  - {host: a, gpus: 1}\n").nodes[0]
    reply = call_agent(broken, wire.DetectSpec(env={}), 20, until=wire.Detected, setup=True)
    assert reply.problem is not None and "`false` failed with status 1" in reply.problem.what and reply.reached
    fine = parse_cluster("transport: local\nnodes:\n  - {host: a, gpus: 1}\n").nodes[0]
    reply = call_agent(fine, wire.DetectSpec(env={}), 20, until=wire.Detected, setup=True)
    assert reply.problem is None and reply.reached
