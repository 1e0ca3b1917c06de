"""Issue 26, item 1: the root cause is the first failure by the failures' own times, with the rank's
own exception; a tie goes to an exception over a signal; the error files are kept in the run logs.
The node's reading of a failed rank's files (node/watch/failures.py) on real files; the rest in fake time.
"""

from __future__ import annotations

import json
import os

import pytest

from orchestrator.diagnose import rankfailures
from orchestrator.node.supervise import decide
from orchestrator.node.watch import failures
from orchestrator.node.protocol import policy
from orchestrator.node.watch.report import FailureReportParser
from orchestrator.diagnose.outcome import Failure
from orchestrator.views.logfiles import RunLogs
from tests.unit.fakejob import Harness

T0 = 1000.0
TRACE = ["Traceback (most recent call last):", '  File "/w/train.py", line 9, in main',
         '    raise RuntimeError("boom")', "RuntimeError: boom"]


def rank_dir(root, run="r1", attempt=0, rank=0):
    where = os.path.join(root, run, f"attempt_{attempt}", str(rank))
    os.makedirs(where, exist_ok=True)
    return where


def write(path, text, mtime=None):
    with open(path, "w") as f:
        f.write(text)
    if mtime is not None:
        os.utime(path, (mtime, mtime))


def error_json(message, stack):
    return json.dumps({"message": {"message": message, "extraInfo": {"py_callstack": stack, "timestamp": "1"}}})


# --- the node's reading (node/watch/failures.py), on real files -------------------------------------------

def test_the_node_reads_each_failed_ranks_error_file_or_traceback_with_its_exact_time(tmp_path):
    root = str(tmp_path)
    write(os.path.join(rank_dir(root, rank=0), "error.json"), error_json("RuntimeError: boom", "\n".join(TRACE)),
          mtime=T0 + 0.25)
    write(os.path.join(rank_dir(root, rank=1), "stderr.log"),
          "step 1\n" + "\n".join(TRACE[:3]) + "\nValueError: bad batch\n[W] process group not destroyed\n",
          mtime=T0 + 0.5)
    write(os.path.join(rank_dir(root, rank=2), "stderr.log"), "no traceback here\n", mtime=T0)
    found = failures.rank_failures(root)
    assert [(f["rank"], f["at"], f["exception"]) for f in found] == [
        (0, T0 + 0.25, "RuntimeError: boom"), (1, T0 + 0.5, "ValueError: bad batch")]
    assert found[0]["trace"] == TRACE and json.loads(found[0]["error_file"])["message"]["message"] == "RuntimeError: boom"
    assert found[1]["trace"][-1] == "ValueError: bad batch" and found[1]["error_file"] is None
    # what a stop made them do is not theirs: only what was written before it
    assert [f["rank"] for f in failures.rank_failures(root, before=T0 + 0.4)] == [0]


def test_the_node_reads_only_the_latest_attempt_bounded_and_never_through_a_link(tmp_path):
    root = str(tmp_path)
    write(os.path.join(rank_dir(root, attempt=0), "error.json"), error_json("OldError: attempt 0", ""), mtime=T0)
    where = rank_dir(root, attempt=1)
    write(os.path.join(where, "stderr.log"), "x" * (3 * failures.READ_MOST) + "\n" + "\n".join(TRACE) + "\n")
    secret = tmp_path / "elsewhere.json"
    secret.write_text(error_json("Leaked: not the job's", ""))
    os.symlink(secret, os.path.join(where, "error.json"))  # planted: not followed, the traceback is read
    os.makedirs(os.path.join(root, "r1", "attempt_x"))  # not torchrun's: ignored
    [found] = failures.rank_failures(root)
    assert found["exception"] == "RuntimeError: boom" and found["error_file"] is None


@pytest.mark.parametrize("text", ["not json", "[1, 2]", '{"message": 7}', '{"message": {"message": ["x"]}}',
                                  '{"other": 1}'])
def test_an_error_file_of_another_shape_falls_back_to_the_traceback(tmp_path, text):
    where = rank_dir(str(tmp_path))
    write(os.path.join(where, "error.json"), text)
    write(os.path.join(where, "stderr.log"), "\n".join(TRACE) + "\n")
    [found] = failures.rank_failures(str(tmp_path))
    assert found["exception"] == "RuntimeError: boom" and found["error_file"] is None


def test_a_huge_exception_is_cut_before_it_travels(tmp_path):
    where = rank_dir(str(tmp_path))
    write(os.path.join(where, "error.json"), error_json("E: " + "y" * 100_000, "z" * 100_000 + "\n"))
    [found] = failures.rank_failures(str(tmp_path))
    assert len(found["exception"]) == failures.LINE_MOST and len(found["error_file"]) > 200_000  # kept whole
    assert all(len(line) <= failures.LINE_MOST for line in found["trace"])
    write(os.path.join(where, "error.json"), error_json("E: big", "z" * failures.ERROR_FILE_MOST))
    assert failures.rank_failures(str(tmp_path)) == []  # past the bound: not read at all (and no traceback)


# --- the rule (node/protocol/policy.py), both ends -----------------------------------------------------------

def test_the_earliest_failure_wins_and_a_tie_goes_to_an_exception_over_a_signal():
    exact = lambda name, at, raised: {"n": name, "at": at, "w": 0.0, "e": raised}  # noqa: E731
    pick = lambda fs: policy.earliest(fs, lambda f: f["at"], lambda f: f["w"], lambda f: f["e"])["n"]  # noqa: E731
    assert pick([exact("peer", T0 + 0.05, "ValueError: x"), exact("first", T0, "RuntimeError: boom")]) == "first"
    # a signal death known to the second (torchrun's report) may have been as late as the exception
    signal = {"n": "signal", "at": T0, "w": 1.0, "e": None}
    assert pick([signal, exact("exception", T0 + 0.4, "RuntimeError: boom")]) == "exception"
    assert pick([signal, exact("later", T0 + 1.5, "RuntimeError: boom")]) == "signal"
    assert pick([exact("signal", T0, None), exact("exception", T0, "RuntimeError: boom")]) == "exception"


def test_a_tie_between_signal_deaths_goes_to_the_one_that_was_no_stop():
    """A rank killed (SIGKILL: the OOM killer, or a user), and torchrun's SIGTERM to its peer, both
    known to the second from torchrun's report: the SIGTERM is what the kill made happen."""
    pick = lambda fs: policy.earliest(fs, lambda f: f["at"], lambda f: 1.0, lambda f: None,  # noqa: E731
                                      lambda f: f["code"] == -15)["n"]
    assert pick([{"n": "terminated", "at": T0, "code": -15}, {"n": "killed", "at": T0, "code": -9}]) == "killed"
    assert pick([{"n": "terminated", "at": T0, "code": -15}, {"n": "killed", "at": T0 + 2, "code": -9}]) == "terminated"


GLOO_PEER = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
             "closed by peer [127.0.0.1]:19139. This is typically caused by a remote worker crashing.")


@pytest.mark.parametrize("peer", [GLOO_PEER, "RuntimeError: [pair.cc:598] Read error [10.0.0.2]:3: Connection reset by peer",
                                  "torch.distributed.DistBackendError: NCCL error: remote process exited or there "
                                  "was a network error, NCCL version 2.28.9"])
def test_a_peers_lost_connection_never_wins_over_the_rank_that_raised(peer):
    """The raising rank's log is written last at its exit, after its peers saw the connection
    close: by the logs' times the peer is first, yet it only says that the raising rank went away."""
    pick = lambda fs: policy.earliest(fs, lambda f: f["at"], exception=lambda f: f["e"])["n"]  # noqa: E731
    raised = {"n": "raised", "at": T0 + 0.3, "e": "RuntimeError: boom from rank 1"}
    assert pick([{"n": "peer", "at": T0, "e": peer}, raised]) == "raised"
    # nor over a rank killed by a signal (the OOM killer), nor when nothing better is near
    assert pick([{"n": "peer", "at": T0, "e": peer}, {"n": "killed", "at": T0 + 2, "e": None}]) == "killed"
    assert pick([{"n": "peer", "at": T0, "e": peer}, dict(raised, at=T0 + policy.PEER_LOST_REACH + 1)]) == "peer"
    assert pick([{"n": "peer", "at": T0, "e": peer}, {"n": "peer2", "at": T0 + 1, "e": peer}]) == "peer"
    assert policy.peer_lost(peer) and not policy.peer_lost("RuntimeError: boom") and not policy.peer_lost(None)


GPU_DATA = os.path.join(os.path.dirname(__file__), "..", "data", "gpu", "h200")


def test_a_traceback_torch_prefixed_with_the_rank_is_read_with_nccls_last_error(tmp_path):
    """Two ranks on one GPU, on a real H200 (NCCL 2.28.9): every stderr line is "[rank0]: ...", and
    the reason is on the line after "Last error:", not on the exception's first line."""
    where = rank_dir(str(tmp_path))
    with open(os.path.join(GPU_DATA, "shared-gpu-rank0.log")) as f:
        write(os.path.join(where, "stderr.log"), f.read())
    [found] = failures.rank_failures(str(tmp_path))
    assert found["exception"].startswith("torch.distributed.DistBackendError: NCCL error in: ")
    assert found["exception"].endswith("(last error: Duplicate GPU detected : rank 0 and rank 1 both on CUDA device 60)")
    assert found["trace"][-1] == "Duplicate GPU detected : rank 0 and rank 1 both on CUDA device 60"
    assert not any(line.startswith("[rank0]") for line in found["trace"])


def test_a_prefixed_traceback_ends_at_torchs_own_log_lines(tmp_path):
    where = rank_dir(str(tmp_path))
    write(os.path.join(where, "stderr.log"), "".join(f"[rank3]: {line}\n" for line in TRACE) +
          "[rank3]:[W1126 01:23:47.069248625 ProcessGroupNCCL.cpp:1575] Warning: destroy_process_group() was not called\n")
    [found] = failures.rank_failures(str(tmp_path))
    assert found["exception"] == "RuntimeError: boom" and found["trace"] == TRACE


# --- the controller: torchrun's report joined with the node's reading -------------------------------

REPORT = ["Failures:", "[1]:", "  time      : 2026-11-24_10:00:01", "  host      : h0",
          "  rank      : 1 (local_rank: 1)", "  exitcode  : -9 (pid: 8)", "-" * 20,
          "Root Cause (first observed failure):", "[0]:", "  time      : 2026-11-24_10:00:00", "  host      : h0",
          "  rank      : 0 (local_rank: 0)", "  exitcode  : 1 (pid: 7)", "=" * 20]


def test_the_report_names_every_failed_rank_and_the_nodes_reading_gives_exceptions_and_exact_times():
    report = FailureReportParser()
    for line in REPORT:
        report.feed(line)
    assert sorted(report.failed) == [0, 1] and report.root.rank == 0
    errors = rankfailures.rank_errors([{"rank": 0, "at": 5000.25, "exception": "RuntimeError: boom",
                                        "trace": TRACE, "error_file": "{}"},
                                       {"rank": "x"}, "garbage", {"rank": 1}], first_rank=0)
    assert [e.rank for e in errors] == [0]  # entries of another shape are left out
    found = rankfailures.own_failures(0, "h0", report, errors, {}, skew=None)
    assert [(f.rank, f.exit_code, f.at, f.window, f.exception) for f in found] == [
        (0, 1, 5000.25, 0.0, "RuntimeError: boom"),
        (1, -9, report.failed[1].time, rankfailures.REPORT_WINDOW, None)]
    # a rank killed by a signal: when the node saw it end, exact
    ends = rankfailures.rank_ends({"1": 4999.5, "x": 1.0, "2": "soon", "3": True}, first_rank=0)
    assert ends == {1: 4999.5}
    found = rankfailures.own_failures(0, "h0", report, errors, ends, skew=None)
    assert [(f.rank, f.at, f.window) for f in found] == [(1, 4999.5, 0.0), (0, 5000.25, 0.0)]
    # a node clock known to be off is corrected; a small measured offset is latency, left alone
    assert rankfailures.own_failures(0, "h0", report, errors, {}, skew=30.0)[0].at == 4970.25
    assert rankfailures.own_failures(0, "h0", report, errors, {}, skew=0.2)[0].at == 5000.25


def failed(rank, at, exception):
    return {"rank": rank, "at": at, "exception": exception, "trace": [exception], "error_file": None}


def test_a_failure_reported_after_the_stop_is_still_the_root_cause_when_it_came_first():
    """The seen bug: rank 0 (node 0) raises, gloo aborts rank 1 (node 1), whose launcher reports
    first; node 0's end arrives after the stop, yet its failure is 50 ms earlier."""
    h = Harness(2)
    h.nodes[1].exit_code, h.nodes[1].run_for = 1, 5.0
    h.nodes[1].failures = [failed(0, T0 + 4.85, "RuntimeError: Connection closed by peer")]
    h.nodes[0].failures = [failed(0, T0 + 4.8, "RuntimeError: boom")]  # in its stopped Exited
    result = h.job.run()
    assert h.states() == ["failed", "failed"]  # node 0's own rank failed: not "stopped, stopped by ddp-up"
    root = result.root_cause
    assert (root.node, root.rank, root.exception) == (0, 0, "RuntimeError: boom")
    # no report from node 0's launcher (it was stopped): Python's exit status for an uncaught exception
    assert root.render() == "h0 (node 0, rank 0): rank 0 exited with code 1: RuntimeError: boom"
    assert root.exit_code is None  # words, not a code: no_restart_on_exit reads only a reported one


def test_two_nodes_word_the_same_kind_of_failure_alike_with_a_report_or_without():
    """One node's launcher reported its failed ranks' codes, the other's was stopped first: both
    said what their ranks did in the same words ("exited with code 1"), not "raised" on one."""
    report = FailureReportParser()
    errors = [rankfailures.RankError(r, T0 + r, "RuntimeError: boom", ("RuntimeError: boom",), None) for r in (1, 2)]
    words = [f.what for f in rankfailures.own_failures(0, "h0", report, errors, {}, None)]
    assert words == ["rank 1 exited with code 1", "rank 2 exited with code 1"]
    interrupted = [rankfailures.RankError(3, T0, "KeyboardInterrupt", (), None)]
    assert [f.what for f in rankfailures.own_failures(0, "h0", report, interrupted, {}, None)] == ["rank 3 raised"]


def test_a_node_stopped_with_no_failure_of_its_own_stays_stopped():
    h = Harness(2)
    h.nodes[1].exit_code, h.nodes[1].run_for = 1, 5.0
    result = h.job.run()
    assert h.states() == ["stopped", "failed"] and result.root_cause.node == 1
    # issue 27, item 1: how long each node took to stop (a failed one was not asked to)
    assert [n.stop_seconds for n in result.nodes] == [0.0, None]
    assert result.nodes[0].detail == "stopped by ddp-up in 0.0 s"


def test_the_root_cause_its_exception_and_the_error_files_reach_summary_json(tmp_path):
    h = Harness(2)
    error = rankfailures.RankError(1, T0, "RuntimeError: boom", tuple(TRACE), error_json("RuntimeError: boom", ""))
    logs = RunLogs(h.plan, str(tmp_path), wall=lambda: T0)
    status = h.job.status[1]
    status.rank_errors, status.state = [error], "failed"
    logs.node_state(status)
    result = h.job.result()
    result = type(result)(result.plan, result.nodes, None,
                          (Failure(1, "h1", 1, 1, "rank 1 exited with code 1", T0, error.exception, error.trace),))
    logs.finished(result)
    summary = json.loads((tmp_path / "J1" / "summary.json").read_text())
    assert summary["root_cause"]["exception"] == "RuntimeError: boom" and summary["root_cause"]["traceback"] == TRACE
    assert json.loads((tmp_path / "J1" / "rank1.error.json").read_text())["message"]["message"] == "RuntimeError: boom"


# --- a detached job: the supervisor decides by the same rule ----------------------------------------

def test_the_supervisor_takes_each_nodes_own_failure_time_and_exception():
    late_heard = decide.node_end("failed", 1, None, False, failed(0, T0, "RuntimeError: boom"), wall=T0 + 3)
    peer = decide.node_end("failed", 1, None, False, failed(2, T0 + 0.05, "RuntimeError: closed by peer"),
                           wall=T0 + 1)
    assert (late_heard["at"], late_heard["rank"], late_heard["exception"]) == (T0, 0, "RuntimeError: boom")
    summary = decide.attempt_summary(0, {0: late_heard, 1: peer}, None, None, T0 + 4)
    assert summary["root_cause"]["node"] == 0 and summary["root_cause"]["exception"] == "RuntimeError: boom"
    # a peer's word of another shape is not trusted for the time: the supervisor's own clock is
    odd = decide.node_end("failed", 1, None, False, {"at": "soon", "rank": True, "exception": 7}, wall=T0 + 2)
    assert (odd["at"], odd["rank"], odd["exception"]) == (T0 + 2, None, None)
    assert decide.node_end("stopped", None, "halted", False, failed(0, T0, "E"), wall=T0 + 2)["at"] == T0 + 2


def test_the_node_sees_each_worker_end_to_the_millisecond_and_only_its_own(tmp_path):
    """A rank killed by a signal leaves no file: its end is what the node saw (a pidfd each)."""
    import signal
    import subprocess
    import sys
    import time

    from orchestrator.node.watch.failures import RankEnds
    tags = {"DDP_UP_JOB": "J", "DDP_UP_NODE": "0", "DDP_UP_RUN": "R"}
    spawn = ("import os, subprocess, sys, time\n"
             "for rank, tagged in ((0, True), (1, True), (2, False)):\n"
             "    env = dict(os.environ, LOCAL_RANK=str(rank))\n"
             "    if not tagged: env = {'LOCAL_RANK': '2'}\n"
             "    subprocess.Popen(['sleep', '30'], env=env)\n"
             "print('started', flush=True)\n"
             "time.sleep(30)\n")
    launcher = subprocess.Popen([sys.executable, "-c", spawn], env=dict(os.environ, **tags), stdout=subprocess.PIPE)
    ends = RankEnds(launcher.pid, tags)
    try:
        assert launcher.stdout.readline() == b"started\n"
        ends.start()
        deadline = time.monotonic() + 10
        while len(ends.watching) < 2 and time.monotonic() < deadline:  # found within its first pass
            time.sleep(0.01)
        assert sorted(ends.watching.values()) == [0, 1]  # the untagged child is not the job's
        rank1 = next(pid for pid in ends.seen if b"LOCAL_RANK=1\0" in open(f"/proc/{pid}/environ", "rb").read())
        killed_at = time.time()
        os.kill(rank1, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while 1 not in ends.ends and time.monotonic() < deadline:
            time.sleep(0.01)
        assert killed_at <= ends.ends[1] < killed_at + 1.0
    finally:
        for pid in ends.seen:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        launcher.kill()
        launcher.wait()
    seen = ends.stop()
    assert 1 in seen and ends.thread is None


def test_a_detached_node_reports_its_first_exception_else_its_first_rank_end():
    from orchestrator.node.supervise.restarts import own_failure
    assert own_failure([failed(1, T0, "E: x")], {"0": T0 - 1}, first_rank=4) == {
        "rank": 5, "at": T0, "exception": "E: x", "trace": ["E: x"], "error_file": None}
    assert own_failure(None, {"1": T0 + 2, "0": T0 + 1}, first_rank=4) == {"rank": 4, "at": T0 + 1, "exception": None}
    assert own_failure(None, None, first_rank=4) is None
