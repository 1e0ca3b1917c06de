"""The job loop, driven by fake nodes and a fake clock: fail-fast, stop escalation, lost nodes,
hangs, and signals at every step. No root, no network, no sleeping: milliseconds each."""

from __future__ import annotations

import signal

import pytest

from orchestrator.node.protocol import policy, wire
from orchestrator.errors import SetupError
from orchestrator.job.events import Message
from orchestrator.job.stoppath import KILL_MARGIN, STOP_MARGIN
from tests.unit.fakejob import Harness

T0 = 1000.0  # the fake clock's start


def test_a_healthy_job_runs_every_node_with_its_rank_and_exits_0():
    h = Harness(3)
    for n in h.nodes:
        n.exit_code = 0
    result = h.job.run()
    assert result.exit_code == 0 and h.states() == ["done"] * 3
    assert [n.kinds() for n in h.nodes] == [["Probe", "Go"]] * 3
    go = [next(f for f in n.sent if isinstance(f, wire.Go)) for n in h.nodes]
    assert [a for a in go[2].argv if a.startswith(("--node-rank", "--master-port", "--nnodes"))] == [
        "--nnodes=3", "--node-rank=2", "--master-port=29500"]
    assert not h.sweeper.swept and not result.failures and result.interrupted is None


def test_heartbeats_go_to_every_live_node_at_the_planned_rate():
    h = Harness(2, orphan_timeout=8)  # heartbeat every 2 s
    for n in h.nodes:
        n.exit_code, n.run_for = 0, 9.0
    h.job.run()
    beats = [sum(isinstance(f, wire.Heartbeat) for f in n.sent) for n in h.nodes]
    assert all(4 <= b <= 6 for b in beats), beats


def test_fail_fast_names_the_root_cause_rank_and_stops_the_others():
    h = Harness(3)
    h.nodes[1].exit_code, h.nodes[1].run_for = 1, 5.0
    report = ["Root Cause (first observed failure):", "[0]:", "  time      : 2026-11-22_10:00:00",
              "  host      : h1", "  rank      : 2 (local_rank: 1)", "  exitcode  : 7 (pid: 42)", "=" * 20]
    h.queue.at(T0 + 4.9, h.lines(1, *report, stream="err"))
    result = h.job.run()
    assert result.exit_code == 1
    assert h.states() == ["stopped", "failed", "stopped"]
    assert [n.kinds()[-1] for n in h.nodes] == ["Stop", "Go", "Stop"]  # nobody stops the failed node
    root = result.root_cause
    assert (root.node, root.rank, root.exit_code, root.what) == (1, 2, 7, "rank 2 exited with code 7")
    assert "h1 failed: rank 2 exited with code 7; stopping all nodes" in h.view.notices


def test_a_node_that_ignores_stop_is_killed_then_lost_and_swept():
    h = Harness(2, stop_grace=3)
    h.nodes[0].exit_code, h.nodes[0].run_for = 1, 2.0
    h.nodes[1].obeys_stop = h.nodes[1].obeys_kill = False
    sent_at: dict[str, float] = {}
    h.nodes[1].on_send = lambda f: sent_at.setdefault(type(f).__name__, h.clock())
    result = h.job.run()
    assert result.exit_code == 1
    assert h.nodes[1].kinds()[-3:] == ["Go", "Stop", "Kill"]
    assert sent_at["Kill"] - sent_at["Stop"] == pytest.approx(3 + STOP_MARGIN, abs=0.3)
    assert h.states() == ["failed", "lost"] and h.nodes[1].closed
    assert h.sweeper.swept == ["h1"]
    assert result.root_cause.node == 0  # the loss was a consequence, not the cause
    assert h.clock() - sent_at["Kill"] == pytest.approx(KILL_MARGIN, abs=0.3)


def test_a_node_whose_channel_closes_is_lost_swept_and_named():
    h = Harness(2)
    h.queue.at(T0 + 3, h.close_channel(1, "client_loop: send disconnect: Broken pipe"))
    result = h.job.run()
    assert result.exit_code == 1 and h.states() == ["stopped", "lost"]
    assert h.sweeper.swept == ["h1"]
    assert result.root_cause.what == "connection to the node agent lost (client_loop: send disconnect: Broken pipe)"
    h.job.close(sweeps=False)
    assert [n.waited for n in h.nodes] == [True, False]  # a lost node's link says nothing more: not waited for


def test_a_silent_node_is_lost_after_orphan_timeout():
    h = Harness(2, orphan_timeout=8)
    h.queue.at(T0 + 2, lambda: setattr(h.nodes[1], "silent_since", h.clock()))
    result = h.job.run()
    assert h.states() == ["stopped", "lost"] and h.sweeper.swept == ["h1"]
    assert result.root_cause.what.startswith("no heartbeat from the node for 8 s")
    assert result.root_cause.at == pytest.approx(T0 + 10, abs=0.3)


def test_an_agent_slower_to_start_than_orphan_timeout_is_not_lost_but_one_that_never_speaks_is():
    """Until its first frame, an agent is starting (the session, `setup:`, the interpreter): a
    loaded node took longer than a 3 s orphan_timeout, and the job failed as if the node were down."""
    h = Harness(2, orphan_timeout=3)
    h.nodes[1].first_word_after = 12.0  # within connect_timeout (10 s) + the setup margin
    for n in h.nodes:
        n.exit_code, n.run_for = 0, 2.0
    assert h.job.run().exit_code == 0 and h.states() == ["done", "done"]
    h = Harness(2, orphan_timeout=3)
    h.nodes[1].first_word_after = 1e9
    with pytest.raises(SetupError, match="h1: no ready report from the node agent"):  # at the ready deadline
        h.job.run()


def test_a_frame_that_makes_no_sense_now_is_a_protocol_error_naming_the_node():
    h = Harness(2)
    h.queue.at(T0 + 1, Message(1, wire.Detected(gpus=3)))
    result = h.job.run()
    assert h.states()[1] == "lost"
    assert result.root_cause.render() == "h1 (node 1): protocol error from the node agent: unexpected Detected while running"


def test_a_hang_asks_for_stacks_and_names_the_odd_rank_out():
    h = Harness(2, gpus=2, hang_timeout=20)
    h.queue.at(T0 + 1, h.lines(0, "step 1", rank=0))
    h.queue.at(T0 + 1, h.lines(1, "step 1", rank=3))
    h.queue.at(T0 + 1, Message(0, wire.RanksUp(ranks=[0, 1])))  # ranks 1 and 2 print nothing: their process
    h.queue.at(T0 + 1, Message(1, wire.RanksUp(ranks=[2, 3])))  # groups are up, so their clocks run

    def stacks(node: int, frame: wire.Frame) -> None:
        if isinstance(frame, wire.Dump):
            for rank in h.plan.nodes[node].ranks:
                where = ("/job/data.py", "load_batch") if rank == 3 else (
                    "/x/torch/distributed/distributed_c10d.py", "all_reduce")
                h.queue.put(h.lines(node, "Thread 0x1 (most recent call first):",
                                    f'  File "{where[0]}", line 1 in {where[1]}',
                                    '  File "/job/train.py", line 9 in step', rank=rank, stream="err"))
            h.nodes[node].say(wire.Dumped(ranks=list(h.plan.nodes[node].ranks)))

    for n in h.nodes:
        n.on_send = lambda f, i=n.index: stacks(i, f)
    result = h.job.run()
    assert any(t.startswith("job looks hung: no output from any rank for 20 s") for t in h.view.notices)
    assert [kind for kind, _, _ in h.view.events] == ["hang"]  # issue 29: sent, once, as it is found
    assert [n.kinds()[2] for n in h.nodes] == ["Dump", "Dump"]
    root = result.root_cause
    assert (root.node, root.rank) == (1, 3)
    assert "rank 3 not in a collective (load_batch); the other 3 rank(s) in all_reduce (from step)" in root.what


def test_a_launcher_finishing_after_its_ranks_ended_is_no_hang():
    """torchrun waits at its exit barrier after its last rank ends (seconds, on a loaded machine):
    its node said so (RanksEnded), and silence past hang_timeout then names no one."""
    h = Harness(2, gpus=1, hang_timeout=5)
    h.queue.at(T0 + 1, h.lines(0, "last line", rank=0))
    h.queue.at(T0 + 1, h.lines(1, "last line", rank=1))
    h.queue.at(T0 + 2, Message(0, wire.RanksEnded()))
    h.queue.at(T0 + 2, Message(1, wire.RanksEnded()))
    for n in h.nodes:
        n.exit_code, n.run_for = 0, 30.0  # torchrun's barrier, long past hang_timeout
    result = h.job.run()
    assert result.exit_code == 0 and not any("hung" in t for t in h.view.notices), h.view.notices
    assert not any(isinstance(f, wire.Dump) for n in h.nodes for f in n.sent)  # no stacks asked for


def test_a_launcher_stopped_at_the_exit_barrier_after_its_ranks_ended_well_is_done():
    """Node 0 ended; node 1's ranks had all ended but its torchrun still waited at the exit barrier
    (a loaded machine) when FINISH_WAIT ran out: stopping it is the end of work already done, so
    the node is done and the job ok, not "stopped" with exit status 1 and no root cause."""
    h = Harness(2, gpus=1)
    h.nodes[0].exit_code, h.nodes[0].run_for = 0, 2.0
    h.queue.at(T0 + 1.5, Message(0, wire.RanksEnded()))
    h.queue.at(T0 + 1.5, Message(1, wire.RanksEnded()))
    h.nodes[1].exit_code, h.nodes[1].run_for = 0, 60.0  # its barrier, past FINISH_WAIT
    result = h.job.run()
    assert result.exit_code == 0 and not result.failures, (result, h.view.notices)
    assert h.states() == ["done", "done"]
    assert result.nodes[1].reason == "every rank ended; its launcher was stopped at torchrun's exit barrier"


def test_stacks_asked_while_the_last_ranks_end_name_no_one_and_the_watch_starts_again():
    """The nodes had not yet said their ranks ended when the watch fired (they say so at their
    next heartbeat): while the stacks are awaited they do, and the job is not failed as hung."""
    h = Harness(2, gpus=1, hang_timeout=5)
    h.queue.at(T0 + 1, h.lines(0, "last line", rank=0))
    h.queue.at(T0 + 1, h.lines(1, "last line", rank=1))
    for n in h.nodes:
        n.on_send = lambda f, n=n: n.say(wire.Dumped(ranks=[])) if isinstance(f, wire.Dump) else None
        n.exit_code, n.run_for = 0, 30.0
        h.queue.at(T0 + 7, Message(n.index, wire.RanksEnded()))  # after the watch fired (6 s in)
    result = h.job.run()
    assert result.exit_code == 0, result
    assert any("their launchers are finishing" in t for t in h.view.notices), h.view.notices


def test_a_node_that_fails_preflight_stops_the_launch_before_anything_starts():
    h = Harness(2)
    h.job.opener = lambda ss: [ss[0].open(), ss[1].say(wire.Failed(what="script train.py not found", fix="copy it"))]
    with pytest.raises(SetupError) as e:
        h.job.run()
    assert [(p.node, p.what, p.fix) for p in e.value.problems] == [("h1", "script train.py not found", "copy it")]
    assert not any(isinstance(f, wire.Go) for n in h.nodes for f in n.sent)


# --- signals are events, at every step -----------------------------------------------------------

def test_ctrl_c_while_a_node_is_still_connecting_cancels_it_and_stops_the_rest():
    h = Harness(3)
    h.job.opener = lambda ss: [s.open() for s in ss if s.index != 2]  # node 2: connect never returns
    h.signal_at(T0 + 1)
    result = h.job.run()
    assert result.exit_code == 130 and not result.failures
    assert h.states() == ["stopped"] * 3 and h.nodes[2].cancelled
    assert all("Go" not in n.kinds() for n in h.nodes)
    assert h.view.notices == ["SIGINT: stopping all nodes (Ctrl-C again to kill now)"]
    assert [(kind, fields) for kind, _, fields in h.view.events] == [("signal", {"signal": "SIGINT"})]


def test_a_signal_before_the_job_loop_first_turns_is_not_lost():
    h = Harness(2)
    h.signal(signal.SIGTERM)  # arrived between the last start-up check and the loop
    result = h.job.run()
    assert result.exit_code == 128 + signal.SIGTERM and h.states() == ["stopped", "stopped"]
    assert all("Go" not in n.kinds() for n in h.nodes)


STEPS = {
    # where the second Ctrl-C lands: after which frame to node 1, how long after, what node 1 does
    "as the Stop goes out": ("Stop", 0.0, {"obeys_stop": False}),
    "while waiting for the stop": ("Stop", 10.0, {"obeys_stop": False}),
    "after the escalation's Kill": ("Kill", 0.0, {"obeys_stop": False, "obeys_kill": False}),
}


@pytest.mark.parametrize("first_at", ["connecting", "probing", "running"])
@pytest.mark.parametrize("step", sorted(STEPS))
def test_a_second_ctrl_c_at_any_step_of_the_stop_path_kills_now(first_at, step):
    trigger, delay, behaviour = STEPS[step]
    h = Harness(2, stop_grace=60)
    for key, value in behaviour.items():
        setattr(h.nodes[1], key, value)
    sent_at: dict[str, float] = {}
    second_at: list[float] = []

    def second() -> None:
        second_at.append(h.clock())
        h.signal()

    def on_send(frame: wire.Frame) -> None:
        kind = type(frame).__name__
        sent_at.setdefault(kind, h.clock())
        if first_at == "probing" and kind == "Probe" and not h.inbox.received:
            h.signal()
        if first_at == "running" and kind == "Go" and not h.inbox.received:
            h.queue.at(h.clock() + 5, h.signal)
        if kind == trigger and len(h.inbox.received) == 1 and not second_at:
            h.queue.at(h.clock() + delay, second)

    h.nodes[1].on_send = on_send
    if first_at == "connecting":  # node 1 connects a second after the first Ctrl-C: it is cancelled
        h.job.opener = lambda ss: [ss[0].open(), h.queue.at(T0 + 2, ss[1].open)]
        h.signal_at(T0 + 1)
    result = h.job.run()
    assert result.exit_code == 130 and not result.failures and result.interrupted == signal.SIGINT
    assert all(s in ("stopped", "lost") for s in h.states()), h.states()
    assert h.view.notices[0] == "SIGINT: stopping all nodes (Ctrl-C again to kill now)"
    if first_at == "connecting":
        assert h.nodes[1].kinds() == [] and h.states()[1] == "stopped"  # never started, nothing to kill
        return
    assert second_at and sent_at["Kill"] <= second_at[0] + 1.0  # the kill went out at once
    assert h.clock() - second_at[0] <= KILL_MARGIN + 1.0  # and the job ended within the kill margin
    if behaviour.get("obeys_kill") is False:
        assert h.states()[1] == "lost" and h.sweeper.swept == ["h1"]


def test_a_third_signal_changes_nothing_and_the_kill_still_completes():
    h = Harness(2, stop_grace=60)
    h.nodes[1].obeys_stop = False

    def on_send(frame: wire.Frame) -> None:
        if isinstance(frame, wire.Go) and not h.inbox.received:
            h.queue.at(h.clock() + 1, lambda: h.signal())
        if isinstance(frame, wire.Stop):
            h.signal()
            h.signal(signal.SIGTERM)

    h.nodes[1].on_send = on_send
    result = h.job.run()
    assert result.exit_code == 130 and result.interrupted == signal.SIGINT
    assert h.nodes[1].kinds().count("Kill") == 1
    assert h.view.notices.count("killing every job process now") == 1


def test_close_sweeps_and_reports_without_taking_signals():
    h = Harness(2)
    h.queue.at(T0 + 1, h.close_channel(1))
    h.job.run()
    h.signal()  # during cleanup: recorded, not acted on
    h.job.close()
    assert all(n.closed for n in h.nodes) and h.sweeper.swept == ["h1"]
    assert h.job.result().interrupted is None



def test_each_node_starts_with_the_interface_of_its_route_unless_its_environment_names_one():
    h = Harness(2)
    for n in h.nodes:
        n.exit_code = 0
    h.nodes[0].probed = dict(iface="eth0", explicit={})
    h.nodes[1].probed = dict(iface="ib0", explicit={"NCCL_SOCKET_IFNAME": "ib"})
    assert h.job.run().exit_code == 0
    go = [next(f for f in n.sent if isinstance(f, wire.Go)) for n in h.nodes]
    assert go[0].env == {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"}
    assert go[1].env == {"GLOO_SOCKET_IFNAME": "ib0"}
    assert [t for t in h.view.notices if "SOCKET_IFNAME" in t] == [
        "GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME set to the interface that reaches the master: h0 eth0, h1 ib0"]


def test_a_setting_with_no_route_or_a_busy_gpu_stops_the_launch_before_go():
    h = Harness(2)
    h.nodes[1].probed = dict(iface="eth0", explicit={"GLOO_SOCKET_IFNAME": "docker0"},
                             bad=[["GLOO_SOCKET_IFNAME", "docker0", "interface docker0 has no route to the master"]])
    h.nodes[0].ready = dict(busy_gpus=[{"gpu": 0, "pid": 7, "user": "bob", "cmd": "python old.py", "mib": 900}])
    with pytest.raises(SetupError) as e:
        h.job.run()
    assert [p.node for p in e.value.problems] == ["h0", "h1"]
    assert "GPU 0: pid 7 (bob, python old.py) holds 900 MiB" in e.value.problems[0].what
    assert "GLOO_SOCKET_IFNAME=docker0" in e.value.problems[1].what
    assert all(n.kinds() == ["Probe"] for n in h.nodes)  # no Go anywhere


def test_busy_gpus_allowed_start_with_a_notice_and_gpu_use_reaches_the_dashboard():
    h = Harness(1, replan=dict(allow_busy_gpus=True))
    h.nodes[0].ready = dict(busy_gpus=[{"gpu": 0, "pid": 7, "user": "bob", "cmd": "x", "mib": 900}])
    h.nodes[0].exit_code = 0

    def report(frame):
        if isinstance(frame, wire.Go):
            h.queue.put(Message(0, wire.GpuUsage(gpus=[[0, 75, 40960, 81920]])))
    h.nodes[0].on_send = report
    assert h.job.run().exit_code == 0
    assert any(t.endswith("holds 900 MiB (--allow-busy-gpus)") for t in h.view.notices)
    assert h.job.snapshot().nodes[0].gpus == "75% 40/80G"


def test_an_unhealthy_gpu_stops_the_launch_before_go_unless_allowed():
    sick = {"index": 3, "uuid": "GPU-3", "ecc_uncorrected": 2, "pcie_width": 8, "pcie_width_max": 16}
    h = Harness(2)
    h.nodes[1].ready = dict(gpu_health=[sick])
    with pytest.raises(SetupError) as e:
        h.job.run()
    [problem] = e.value.problems
    assert problem.node == "h1" and problem.what.startswith("GPU 3: 2 uncorrected ECC error(s)"), problem
    assert "nvidia-smi -r -i 3" in problem.fix and "--allow-unhealthy-gpus" in problem.fix
    assert all(n.kinds() == ["Probe"] for n in h.nodes)  # no Go anywhere
    h = Harness(2, replan=dict(allow_unhealthy_gpus=True))
    h.nodes[1].ready = dict(gpu_health=[sick])
    for node in h.nodes:
        node.exit_code = 0
    assert h.job.run().exit_code == 0
    said = [t for t in h.view.notices if "GPU 3" in t]
    assert len(said) == 2 and said[0].startswith("h1: GPU 3: 2 uncorrected ECC error(s)"), said
    assert said[0].endswith("(--allow-unhealthy-gpus)") and said[1].startswith("h1: GPU 3: PCIe link x8 of x16")


def test_gpu_memory_a_jobs_process_still_holds_after_its_end_is_named():
    h = Harness(1)
    h.job.events.put(Message(0, wire.Exited(code=0, signal=None, stopped=False, reason=None,
                                            gpu_left=[{"gpu": "GPU-1", "pid": 9, "user": "me", "cmd": "python t.py",
                                                       "mib": 512}])))
    h.job.status[0].state = "running"
    h.job.turn(None)
    assert h.view.notices == ["h0: 1 process(es) of this job still hold GPU memory after its end: GPU GPU-1: pid 9 "
                              "(me, python t.py) holds 512 MiB"]


def test_a_vetted_node_skips_the_torch_probe_and_its_earlier_build_is_still_compared():
    """Restarts: a node whose preflight passed in an earlier attempt is not asked to import torch
    again; the build it reported then takes part in the cross-node check."""
    h = Harness(2, replan=dict(vetted={"h1": {"torch": "2.12.0", "cuda": None, "nccl": None}}))
    assert [h.job.plan.agent_spec(n).needs_torch for n in h.job.plan.nodes] == [True, False]
    h.nodes[1].ready = dict(torch=None)  # what an agent that skipped the probe reports
    with pytest.raises(SetupError) as e:
        h.job.run()
    assert [p.node for p in e.value.problems] == ["h1"]
    assert "torch 2.12.0 here, torch 2.13.0 on the master" in e.value.problems[0].what


def test_a_graceful_stop_says_every_10_s_how_many_nodes_still_stop_and_how_long_is_left():
    """Issue 27, item 1: the plain output says what is happening while the ranks save."""
    h = Harness(2, stop_grace=30)
    h.nodes[0].exit_code, h.nodes[0].run_for = 1, 2.0
    h.nodes[1].obeys_stop = False
    h.job.run()
    reminders = [n for n in h.view.notices if n.startswith("stopping:")]
    assert reminders == [f"stopping: 1 node(s) still running their ranks' stop, {left} s of stop_grace left; "
                         "Ctrl-C again kills them now" for left in (20, 10, 0)], h.view.notices
    assert h.states() == ["failed", "stopped"]


def test_a_node_stopped_from_outside_dates_from_its_agents_stop_and_is_not_the_jobs_failure():
    """Issue 27, item 5: an agent stopping on a signal ddp-up did not send (Slurm, a shutdown) is
    a failure of kind "outside" at the agent's own time, though its peer's failure (of it) was
    heard first; every other node stops with its grace."""
    h = Harness(3)
    h.nodes[2].exit_code, h.nodes[2].run_for = 1, 4.1  # its gloo error: the peer it lost
    h.nodes[1].obeys_stop = False  # still stopping on its own when ddp-up's Stop comes
    h.queue.at(T0 + 4.2, lambda: h.nodes[1].say(wire.Stopping(reason="agent got SIGTERM", by="signal", at=T0 + 4.0)))
    result = h.job.run()
    root = result.root_cause
    assert (root.node, root.kind, root.what) == (1, "outside", "stopped on the node: agent got SIGTERM"), result.failures
    assert result.exit_code == 1 and result.interrupted is None
    assert [f.kind for f in sorted(result.failures, key=lambda f: f.node)] == ["outside", "own"]


def test_a_node_whose_link_dropped_for_a_while_and_stopped_its_ranks_was_lost_not_stopped_from_outside():
    """A flapping link: the node heard nothing from ddp-up for orphan_timeout and stopped its
    ranks; the link came back in time for it to say so. It was lost for a while (a recovery, and
    out until it answers again), in those words, not a stop from outside."""
    h = Harness(2)
    reason = policy.controller_silent_words(3.2)
    h.queue.at(T0 + 3.0, lambda: h.nodes[1].say(wire.Stopping(reason=reason, at=T0 + 3.0)))
    h.queue.at(T0 + 3.1, lambda: h.nodes[1].say(wire.Exited(code=-15, signal="SIGTERM", stopped=True, reason=reason)))
    result = h.job.run()
    root = result.root_cause
    assert (root.node, root.kind) == (1, "lost"), result.failures
    assert root.what == "its link dropped for a while: the node heard nothing from ddp-up for 3 s and stopped its ranks"
    assert h.states()[1] == "lost" and result.exit_code == 1


def test_a_stop_by_ddp_kill_ends_the_run_as_a_sigterm_to_ddp_up_would():
    """ddp-kill's SIGTERM to an agent (with its note): the run is over (no restart), every node
    stopped with its grace, exit status 143; no failure is recorded."""
    h = Harness(2)
    h.queue.at(T0 + 3.0, lambda: h.nodes[1].say(wire.Stopping(reason="stopped by ddp-kill", by="ddp-kill", at=T0 + 3.0)))
    result = h.job.run()
    assert result.interrupted == signal.SIGTERM and result.exit_code == 143 and not result.failures
    assert "h1: stopped by ddp-kill; stopping all nodes" in h.view.notices
    assert h.nodes[0].kinds()[-1] == "Stop"


# --- progress bars (issue 29) ----------------------------------------------------------------------

def test_a_moving_bar_is_progress_shown_in_the_rows_and_a_slow_node_is_told_once():
    h = Harness(2, hang_timeout=20)
    snaps = []
    h.view.tick = lambda snapshot: snaps.append(snapshot())
    for n in h.nodes:
        n.exit_code, n.run_for = 0, 60.0
    for t in range(1, 60, 5):  # no line for a minute, but both bars move: node 1 at half the rate
        for node, rate in ((0, 10), (1, 5)):
            row = f"train: {t * rate // 10}%|#| {t * rate}/{100 * rate} [00:{t:02d}<00:10, {rate}.00it/s]"
            h.queue.at(T0 + t, Message(node, wire.Bars(bars=[["err", 0, [row]], ["out", 7, ["not a rank here"]]])))
    result = h.job.run()
    assert result.exit_code == 0 and not h.view.events[1:]  # no hang: a moving bar is progress
    assert [kind for kind, _, _ in h.view.events] == ["straggler"]
    assert h.view.notices.count("h1 is a straggler: its progress goes at 0.50x the others' median rate") == 1
    assert [b.rank for b in h.view.bars_seen][:2] == [0, 1]  # global ranks; the bogus local rank is dropped
    row0, row1 = next(s for s in reversed(snaps) if s.nodes[0].bar and s.nodes[0].state == "running").nodes
    assert row0.bar.startswith("train: ") and row0.progress.startswith("5") and row1.slow == "0.50x"
    assert snaps[-1].eta is None or snaps[-1].eta >= 0


def test_a_bar_redrawn_without_its_count_moving_is_no_progress_and_the_hang_is_found():
    """rich and Lightning redraw a bar on a timer while a collective is stuck: its elapsed time
    changes, its count does not. Only a count that moves is progress."""
    h = Harness(1, hang_timeout=6)
    h.queue.at(T0 + 1, h.lines(0, "step 0", rank=0))
    for t in range(2, 40):
        row = f"train:  10%|#| 1/10 [00:{t:02d}<01:30, 0.50it/s]"  # the same count, redrawn every second
        h.queue.at(T0 + t, Message(0, wire.Bars(bars=[["err", 0, [row]]])))
    h.nodes[0].on_send = lambda f: isinstance(f, wire.Dump) and h.nodes[0].say(wire.Dumped(ranks=[0]))
    result = h.job.run()
    assert any(t.startswith("job looks hung: no output from any rank for") for t in h.view.notices), h.view.notices
    assert result.root_cause.what.startswith("job hung") and result.root_cause.at < T0 + 12


def test_a_secret_in_a_bar_is_masked_as_in_a_line():
    h = Harness(1, env="{HF_TOKEN: hf_s3cr3t}")
    h.nodes[0].exit_code, h.nodes[0].run_for = 0, 3.0
    h.queue.at(T0 + 1, Message(0, wire.Bars(bars=[["err", 0, ["push to hf_s3cr3t: 10%|#| 1/10"]]])))
    h.job.run()
    assert [b.rows for b in h.view.bars_seen] == [("push to ***: 10%|#| 1/10",)]


def test_importing_torch_for_longer_than_hang_timeout_is_no_hang():
    """A loaded node or a venv on NFS: 30 s of imports before the first line, hang_timeout 12."""
    h = Harness(2, hang_timeout=12)
    for n in range(2):
        h.queue.at(T0 + 30, h.lines(n, "step 0", rank=n))
        h.queue.at(T0 + 31, lambda n=n: h.nodes[n].say(wire.Exited(code=0, signal=None, stopped=False, reason=None)))
    result = h.job.run()
    assert result.exit_code == 0 and not h.view.events, h.view.notices


def test_a_rank_that_never_reaches_init_process_group_is_named_with_its_own_limit():
    h = Harness(2, gpus=2, hang_timeout=12, startup_timeout=60)
    h.queue.at(T0 + 5, Message(0, wire.RanksUp(ranks=[0, 1, 7])))  # 7 is not node 0's: ignored
    h.queue.at(T0 + 8, h.lines(1, "loading data", rank=2))  # a line starts a rank's clock too
    for n in h.nodes:
        n.on_send = lambda f, i=n.index: isinstance(f, wire.Dump) and h.nodes[i].say(wire.Dumped(ranks=[]))
    result = h.job.run()
    assert any(t.startswith("job looks hung: rank 3 has not reached init_process_group after 6") for t in h.view.notices)
    root = result.root_cause
    assert (root.node, root.rank) == (1, 3)
    assert root.what.startswith("job did not start: rank 3 has not reached init_process_group after 6")
    assert root.at < T0 + 70  # not hang_timeout's 12 s after the first line, nor a default of minutes


def test_start_up_is_given_at_least_ten_minutes_unless_told():
    from orchestrator.job.hang import HangWatch
    from orchestrator.node.protocol.policy import STARTUP_LEAST

    assert HangWatch(12, "J").startup == STARTUP_LEAST == 600 and HangWatch(900, "J").startup == 900
    assert HangWatch(None, "J").startup is None and HangWatch(12, "J", startup=30).startup == 30


# --- growing back ---------------------------------------------------------------------------------

def test_nodes_that_answer_again_stop_the_job_with_its_grace_and_the_attempt_ends_stopped_to_grow():
    from orchestrator.run.attempts import attempt_end, blame
    h = Harness(2, stop_grace=30)
    h.queue.at(T0 + 3.0, lambda: h.job.grow({"h9"}))
    result = h.job.run()
    assert [n.kinds()[-1] for n in h.nodes] == ["Stop", "Stop"] and h.states() == ["stopped", "stopped"]
    assert not result.failures and result.interrupted is None and result.exit_code == 1
    assert h.job.reshape is not None and h.job.reshape.join == {"h9"}
    assert any(t.startswith("h9 answer(s) again: stopping all nodes with their grace (stop_grace: 30 s to save)")
               for t in h.view.notices), h.view.notices
    assert attempt_end(result, blame(result), reshape=h.job.reshape) == "stopped to grow"


def test_a_grow_asked_while_the_job_stops_for_a_failure_changes_nothing():
    h = Harness(2)
    h.nodes[1].exit_code, h.nodes[1].run_for = 1, 2.0
    h.queue.at(T0 + 2.5, lambda: h.job.grow({"h9"}))
    result = h.job.run()
    assert h.job.reshape is None and result.root_cause.node == 1
    assert not any("answer(s) again" in t for t in h.view.notices)


def test_a_node_that_straggles_for_evict_after_stops_the_job_to_be_set_aside_saying_why():
    """The straggler measure (Arrivals: node 2's rank comes 200 ms after the others to every
    collective) names node 2; once it has for evict_after, the job stops with its grace, naming
    its lateness and what nvidia-smi said of its GPUs at the preflight. Without evict_after in the
    plan (no spare, min_nodes at the size), it is only named."""
    from orchestrator.run.attempts import attempt_end, blame

    def straggling(replan):
        h = Harness(3, replan=replan)
        h.nodes[2].ready = {"gpu_health": [{"index": 0, "sw_thermal": True, "temp": 91, "sm_clock": 900,
                                            "sm_max": 1980}]}
        for n in h.nodes:
            n.exit_code, n.run_for = 0, 60.0
        for seq in range(100):
            at = T0 + 5.0 + seq * 0.5
            for node, late in ((0, 0.0), (1, 0.01), (2, 0.2)):
                h.queue.at(at, Message(node, wire.Arrivals(times=[["0", seq, at + late, node]])))
        return h, h.job.run()

    h, result = straggling({"evict_after": 10.0})
    said = [t for t in h.view.notices if "has straggled for 10 s" in t]
    assert len(said) == 1 and said[0].startswith(
        "h2 has straggled for 10 s (rank 2 arrives last at 100% of the job's collectives, 195 ms after the others); "
        "its GPUs at the preflight: GPU 0: SW thermal slowdown active (91 °C, SM clock 900 of 1980 MHz)"), h.view.notices
    assert said[0].endswith(": stopping all nodes with their grace (stop_grace: 10 s to save), to start again without "
                            "delay")
    assert h.job.reshape.aside == "h2" and h.states() == ["stopped"] * 3 and not result.failures
    assert attempt_end(result, blame(result), reshape=h.job.reshape) == "stopped to set a node aside"
    h, result = straggling({})
    assert h.job.reshape is None and result.exit_code == 0 and any("h2 is a straggler" in t for t in h.view.notices)


def test_a_node_whose_ssh_session_never_logs_in_is_not_reached_soon_after_its_connect_timeout():
    """A later attempt's session over a shared connection whose link died meanwhile: ssh's own
    connect_timeout does not apply, and the node waited out the whole ready deadline (32 s). Its
    shell's first byte never comes: the node is not reached at connect_timeout + LOGIN_MARGIN."""
    from orchestrator.job import phases

    h = Harness(2)
    h.nodes[1].connects = False  # its agent never speaks
    h.nodes[1].logged_in = False  # nor its shell
    h.nodes[1].started, h.nodes[1].silent_since = True, T0  # its ssh client runs, silent since it started
    with pytest.raises(SetupError) as e:
        h.job.run()
    limit = 10 + phases.LOGIN_MARGIN  # connect_timeout's default
    problem = e.value.problems[0]
    assert problem.node == "h1" and problem.what.startswith("not reached: its ssh session has not logged in after")
    assert "`ssh h1 true`" in problem.fix
    assert h.clock() - T0 < limit + 2 < phases.ready_deadline(h.plan, T0) - T0


def test_a_rank_whose_warm_interpreter_died_under_it_names_that_as_its_root_cause():
    """The warm interpreter was killed (the OOM killer) while the ranks it forked ran: their exit
    statuses went with it, and torchrun reports rank 0 "exited with code 1". The root cause now
    says what happened, not only that code."""
    from tests.unit.test_logparse import TORCHRUN_FAILURE

    h = Harness(2, gpus=1)
    died = policy.warm_died_words(4242, "was killed by SIGKILL")
    report = TORCHRUN_FAILURE.replace("rank      : 5 (local_rank: 1)", "rank      : 1 (local_rank: 0)") \
        .replace("exitcode  : -9", "exitcode  : 1")
    h.queue.at(T0 + 2.0, h.lines(1, *report.splitlines(), stream="err"))
    h.queue.at(T0 + 2.1, lambda: h.nodes[1].say(wire.Exited(code=1, signal=None, stopped=False, reason=died)))
    result = h.job.run()
    root = result.root_cause
    assert (root.node, root.rank, root.what) == (1, 1, "rank 1 exited with code 1"), result.failures
    assert root.exception == "its warm interpreter (pid 4242) was killed by SIGKILL while its ranks ran: their exit " \
                             "statuses are lost"
