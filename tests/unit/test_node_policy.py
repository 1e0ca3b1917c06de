"""The decisions both ends make (node/protocol/policy.py), the detached job's own (node/supervise/decide.py), and the
agent's events (node/protocol/events.py): pure, in fake time."""

from __future__ import annotations

import pytest

from orchestrator.run import attempts
from orchestrator.job import hang
from orchestrator.diagnose import outcome
from orchestrator.node.supervise import decide
from orchestrator.node.protocol import events, policy, wire

T0 = 1000.0


def test_the_restart_limit_and_delay_are_one_rule_for_both_ends():
    limits = {"restart": 2, "recovery": 1}
    assert policy.next_attempt("failed", [], limits, {}) == ("restart", "restart 1 of 2")
    assert policy.next_attempt("hung", [], limits, {"restart": 2}) == (None, "no restart left (restarts: 2)")
    assert policy.next_attempt("failed", [], {"restart": 0}, {}) == (None, "no restarts set")
    assert policy.next_attempt("stopped from outside", [], limits, {"restart": 2}) == (
        "recovery", "recovery 1 of 1 (not the job's own failure: restarts: untouched)")
    assert policy.next_attempt("succeeded", [], limits, {})[0] is None
    assert policy.next_attempt("failed", [], limits, {}, unfixable="rank 3 exited with 2, ...") == (
        None, "rank 3 exited with 2, ...")
    same = [(n, "exit #: ValueError", 5.0) for n in range(3)]
    assert policy.next_attempt("failed", same, {"restart": 9}, {})[1].startswith("crash loop: attempts 0 to 2")
    assert policy.unfixable_exit(2, (2, 64), "h1 rank 3") == "h1 rank 3 exited with 2, which no_restart_on_exit lists: no restart"
    assert policy.unfixable_exit(1, (2,), "h1") is None and policy.unfixable_exit(True, (1,), "h1") is None
    assert [policy.restart_delay(a, 10.0) for a in (1, 2, 3)] == [10.0, 20.0, 30.0]


def test_a_zero_restart_delay_backs_off_instead_of_spinning():
    """Issue 26, item 11: `restart_delay: 0` with many restarts must not start a failing job again
    and again at once: the wait doubles from a quarter second up to a minute."""
    assert [policy.restart_delay(a, 0) for a in range(1, 12)] == [0.25, 0.5, 1, 2, 4, 8, 16, 32, 60, 60, 60]
    assert [policy.restart_delay(a, 0.5) for a in (1, 2)] == [0.5, 1.0]  # a delay of its own is kept
    assert policy.restart_delay(1000, 0) == 60 and policy.restart_delay(1000, 1.0) == 1000.0  # no overflow
    assert attempts.delay_before(3, 10.0) == policy.restart_delay(3, 10.0)  # the controller asks the policy


def test_a_hang_is_no_line_for_the_timeout_or_a_node_done_that_long_before_the_others():
    assert policy.hang_reason(T0 + 59, T0, None, 60, running=2) is None
    assert policy.hang_reason(T0 + 61, T0, None, 60, running=2) == "no output from any rank for 61 s"
    assert policy.hang_reason(T0 + 61, T0 + 60, T0, 60, running=1) == "a node finished 61 s ago, 1 still running"
    assert policy.hang_reason(T0 + 1000, T0, None, None, running=2) is None  # no hang_timeout: never
    assert policy.hang_reason(T0 + 1000, T0, None, 60, running=0) is None  # nothing runs: not a hang


def test_silence_past_the_limit_counts_and_the_root_cause_is_the_earliest():
    assert policy.silence(T0 + 30, T0, 30) is None and policy.silence(T0 + 31, T0, 30) == 31
    failures = [{"at": 3.0, "n": "late"}, {"at": 1.0, "n": "first"}, {"at": 2.0, "n": "middle"}]
    assert policy.earliest(failures, lambda f: f["at"])["n"] == "first"
    assert policy.earliest([], lambda f: f["at"]) is None
    plan = type("Plan", (), {})()
    result = outcome.JobResult(plan, (), None, (outcome.Failure(1, "b", 3, 1, "late", 5.0),
                                                outcome.Failure(0, "a", 0, 1, "first", 4.0)))
    assert result.root_cause.what == "first"  # the controller's root cause is the same rule


def test_the_controllers_hang_watch_and_the_supervisor_say_the_same():
    watch = hang.HangWatch(60, "J1")
    watch.started(T0 - 5)
    watch.ranks_up([0], T0)  # its process group up: its clock starts
    statuses = [outcome.NodeStatus(type("NodePlan", (), {"index": 0, "ranks": range(0, 1)})(), state="running")]
    asked = watch.check(T0 + 61, statuses, stopping=False)
    dump = decide.hang_step(T0 + 61, 60, None, None, {0: 61.0}, None)
    assert isinstance(asked, hang.AskStacks) and dump == ("dump", asked.why)


def test_the_supervisor_counts_no_silence_of_a_node_whose_ranks_have_all_ended():
    progress = decide.NodesProgress()
    progress.said = {1: (50.0, T0, [], True)}  # node 1: every rank ended, its launcher finishing
    own = {0: (70.0, T0, [], False)}
    assert progress.quiet([0, 1], T0, {0: T0, 1: T0}, own) == {0: 70.0} and progress.ended([0, 1], own)
    assert decide.hang_step(T0, 60, None, None, progress.quiet([1], T0, {1: T0}, own), None) is None
    own = {0: (70.0, T0, [], True)}  # and once node 0's have too, nobody is quiet: no hang at all
    assert progress.quiet([0, 1], T0, {0: T0, 1: T0}, own) == {}
    assert decide.hang_step(T0 + 500, 60, None, None, progress.quiet([0, 1], T0, {0: T0, 1: T0}, own), T0) is None


def test_the_supervisor_dumps_then_halts_a_hung_job_in_fake_time():
    quiet = {0: 10.0, 1: 70.0}  # node 0's ranks printed 10 s ago: the job prints
    assert decide.hang_step(T0, 60, None, None, quiet, None) is None
    quiet = {0: 61.0, 1: 70.0}
    assert decide.hang_step(T0, 60, None, None, quiet, None) == ("dump", "no output from any rank for 61 s")
    hung = ("no output from any rank for 61 s", T0)
    assert decide.hang_step(T0 + policy.HANG_DUMP_WAIT, 60, hung, None, quiet, None) is None  # stacks' time
    assert decide.hang_step(T0 + policy.HANG_DUMP_WAIT + 1, 60, hung, None, quiet, None) == \
        ("halt", "job hung (no output from any rank for 61 s)")
    assert decide.hang_step(T0 + 100, 60, hung, "node 1 failed", quiet, None) is None  # halted already
    assert decide.hang_step(T0 + 100, None, None, None, quiet, None) is None  # no hang_timeout


def test_a_detached_job_whose_ranks_have_not_begun_gets_start_up_s_limit_not_the_silence_s():
    """Importing torch on a loaded node is no hang: the supervisor, as ddp-up's HangWatch, counts
    start-up from the launch, and names the ranks that have not begun."""
    quiet, limit = {0: 200.0, 1: 200.0}, policy.startup_limit(None, 60)
    assert limit == policy.STARTUP_LEAST and policy.startup_limit(30, 60) == 30 and policy.startup_limit(None, None) is None
    assert decide.hang_step(T0, 60, None, None, quiet, None, startup=limit, late=[3], since_launch=200) is None
    assert decide.hang_step(T0, 60, None, None, quiet, None, startup=limit, late=[3, 2], since_launch=601) == \
        ("dump", "ranks 2-3 have not reached init_process_group after 601 s")
    assert decide.hang_step(T0, 60, None, None, quiet, None, startup=limit, late=None, since_launch=601) == \
        ("dump", "not every rank began within 601 s")  # a node that has not said which
    assert decide.hang_step(T0, None, None, None, quiet, None, startup=30, late=[1], since_launch=31) == \
        ("dump", "rank 1 has not reached init_process_group after 31 s")  # startup_timeout alone watches start-up
    assert decide.hang_step(T0, 60, None, None, quiet, None, startup=limit, late=[], since_launch=200) == \
        ("dump", "no output from any rank for 200 s")  # every rank began: the silence counts


def test_a_peer_is_lost_after_orphan_timeout_unless_it_has_ended():
    heard = {1: T0, 2: T0, 3: T0 + 20}
    states = {2: {"state": "failed"}}
    assert decide.lost_peers(T0 + 31, [1, 2, 3], heard, states, 30) == [(1, 31.0)]
    assert decide.lost_peers(T0 + 29, [1, 2, 3], heard, states, 30) == []


def test_the_attempt_summary_names_the_earliest_failure_or_the_hang():
    states = {0: {"state": "stopped", "code": -15, "reason": "halted", "at": T0 + 2, "final": False},
              1: {"state": "failed", "code": 7, "reason": None, "at": T0 + 1, "final": False}}
    summary = decide.attempt_summary(0, states, None, "node 1 failed (exit code 7)", T0 + 5)
    assert summary["root_cause"]["node"] == 1 and summary["ended"] == T0 + 5
    assert set(summary["nodes"]) == {"0", "1"}
    hung = decide.attempt_summary(0, states, ("quiet", T0), "job hung (quiet)", T0 + 9)
    assert hung["root_cause"] == {"node": None, "state": "hung", "code": None, "reason": "job hung (quiet)",
                                  "at": T0 + 9}
    assert decide.describe_end("failed", 7, None) == "failed (exit code 7)"
    assert decide.describe_end("lost", None, "no word") == "lost (no word)"


def test_every_frame_the_agent_takes_becomes_one_named_event():
    assert events.from_controller(wire.Go(argv=["x"])) == events.Go(wire.Go(argv=["x"]))
    assert events.from_controller(wire.Stop()) == events.Stop("stopped by ddp-up")
    assert events.from_controller(wire.Kill()) == events.Stop("stopped by ddp-up", True)
    assert events.from_controller(wire.Dump()) == events.Dump()
    assert events.from_controller(wire.Heartbeat()) is None
    assert events.from_controller(wire.Restart(attempt=1, port=2)) == events.Stop(
        "protocol error from the controller: Restart in run mode")  # a peer's frame has no business here
    assert events.from_supervisor(wire.Halt(reason="r"), 2) == events.Halt(2, "r")
    assert events.from_supervisor(wire.DumpStacks(), 0) == events.Dump()
    assert events.from_supervisor(wire.Restart(attempt=1, port=9), 0) == events.Restart(wire.Restart(attempt=1, port=9))
    assert events.from_supervisor(wire.Restart(attempt=1, port=9), 1) is None  # begun already
    assert events.from_supervisor(wire.RunOver(reason="done"), 0) == events.Over("done")
    assert events.Stop("x") != events.Stop("x", True) and repr(events.Halt(1, "r")) == "Halt(attempt=1, reason='r', peer_lost=False)"


def test_the_controllers_frames_are_read_into_events_until_the_stream_ends():
    import io

    got: list = []
    heard: list = []
    stream = io.BytesIO(wire.Heartbeat().encode() + wire.Go(argv=["x"]).encode() + wire.Stop().encode())
    events.read_controller(stream, got.append, lambda: heard.append(1))
    assert got == [events.Go(wire.Go(argv=["x"])), events.Stop("stopped by ddp-up"),
                   events.ControllerGone("controller connection closed")]
    assert len(heard) == 3  # every frame, the heartbeat too, keeps the dead-man switch quiet
    got.clear()
    events.read_controller(io.BytesIO(b"Bogus {}\n" + wire.Go(argv=["x"]).encode()), got.append, lambda: None)
    assert len(got) == 1 and got[0].reason.startswith("protocol error from the controller")  # and no more read


def test_launchers_left_at_torchrun_s_exit_barrier_once_every_rank_has_ended_are_named_after_a_grace():
    """Every node ended, or said its ranks all had: FINISH_WAIT later, the ones still running are
    named (a launcher waits there 300 s for one that ended without reaching it). A node whose ranks
    still run is never named."""
    def status(index, state):
        return outcome.NodeStatus(type("NodePlan", (), {"index": index, "ranks": range(index, index + 1)})(), state=state)
    watch = hang.HangWatch(60, "J1")
    running = [status(0, "running"), status(1, "running")]
    assert watch.lingering(T0, running) == () and watch.linger_deadline is None  # node 1's ranks still run
    watch.ranks_ended(0, T0)
    watch.ranks_ended(1, T0)
    assert watch.lingering(T0 + 60, running) == ()  # every launcher at the barrier: it completes by itself
    watch = hang.HangWatch(60, "J1")
    ended = [status(0, "running"), status(1, "done")]
    watch.ranks_ended(0, T0)
    assert watch.lingering(T0, ended) == () and watch.linger_deadline == T0 + hang.FINISH_WAIT
    assert watch.lingering(T0 + hang.FINISH_WAIT - 0.1, ended) == ()
    assert watch.lingering(T0 + hang.FINISH_WAIT, ended) == (0,)


def test_an_auto_master_port_is_picked_below_the_kernels_ephemeral_range():
    """Between the port's release at Go and the bind of torchrun's store, the kernel could hand a
    port of its ephemeral range to any outgoing connection (EADDRINUSE, once, in the suite): an
    auto port is one it never hands out. A port taken is passed over."""
    import socket

    from orchestrator.node.attempt import checks

    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        first = int(f.read().split()[0])
    if first <= checks.AUTO_PORTS:
        pytest.skip(f"the ephemeral range starts at {first}: no room below it")
    held = checks.PortHold(0)
    try:
        assert checks.AUTO_PORTS <= held.port < first
        taken = held.port
        draws = iter([taken, taken, taken + 1 if taken + 1 < first else taken - 1])
        other = checks.below_ephemeral(draw=lambda: next(draws))
        assert other is not None and other.getsockname()[1] != taken
        other.close()
        assert checks.below_ephemeral(tries=2, draw=lambda: taken) is None  # none free: the kernel's pick
    finally:
        held.close()
    with socket.socket() as s:
        s.bind(("", 0))
        assert s.getsockname()[1] >= first  # what the kernel picks: its range
