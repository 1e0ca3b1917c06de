from orchestrator.node.watch.report import FailureReportParser

TORCHRUN_FAILURE = """\
E1122 07:16:01.123000 4242 torch/distributed/elastic/multiprocessing/api.py:900] failed (exitcode: 3)
Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
============================================================
job.py FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-22_07:16:01.100000
  host      : node2
  rank      : 5 (local_rank: 1)
  exitcode  : -9 (pid: 1234)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 1234
============================================================
"""


def test_root_cause_is_parsed_from_torchrun_report():
    p = FailureReportParser()
    for line in TORCHRUN_FAILURE.splitlines():
        p.feed(line)
    assert p.root is not None
    assert (p.root.rank, p.root.exit_code, p.root.host) == (5, -9, "node2")
    assert p.root.time is not None


def test_no_report_no_root():
    p = FailureReportParser()
    p.feed("rank      : 3 (local_rank: 0)")  # outside a root-cause block
    assert p.root is None


def dump(report, rank, frames):
    report.feed(rank, "Current thread 0x00007f (most recent call first):")
    for path, fn in frames:
        report.feed(rank, f'  File "{path}", line 1 in {fn}')


C10D = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
LOGGER = "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py"


def test_stack_report_names_the_rank_outside_the_collective():
    from orchestrator.diagnose.logparse import StackReport

    r = StackReport()
    for rank in range(3):  # three ranks wait in all_reduce ...
        dump(r, rank, [(C10D, "all_reduce"), (LOGGER, "wrapper"), ("/job/train.py", "step")])
    dump(r, 3, [("/job/data.py", "load_batch"), ("/job/train.py", "step")])  # ... one is elsewhere
    assert r.odd_ones_out() == [3]
    assert r.describe(3) == "not in a collective (load_batch)"
    assert r.describe(0) == "in all_reduce (from step)"


def test_stack_report_names_the_rank_alone_in_a_collective():
    from orchestrator.diagnose.logparse import StackReport

    r = StackReport()
    dump(r, 0, [("/job/x.py", "wait_for_peers")])
    dump(r, 1, [("/job/x.py", "wait_for_peers")])
    dump(r, 2, [(C10D, "barrier"), ("/job/x.py", "sync")])
    assert r.odd_ones_out() == [2]
    r2 = StackReport()
    dump(r2, 0, [(C10D, "barrier")])
    assert r2.odd_ones_out() == []  # everyone in the same place: no odd one out


PYSPY_DUMP = """\
Process 21628: /usr/bin/python3 -u /work/job.py hang
Python v3.11.7 (/usr/bin/python3.11)

Thread 21700 (idle): "Thread-1 (watch)"
    wait (threading.py:327)
Thread 21628 (idle): "MainThread"
    all_reduce (torch/distributed/distributed_c10d.py:2812)
    wrapper (torch/distributed/c10d_logger.py:83)
    block_forever (job.py:42)
    main (job.py:110)
"""


def test_stack_report_reads_py_spy_dumps_from_the_main_thread():
    from orchestrator.diagnose.logparse import StackReport

    report = StackReport()
    for line in PYSPY_DUMP.splitlines():
        report.feed(2, line)
    assert report.describe(2) == "in all_reduce (from block_forever)"


def test_the_workers_torchrun_killed_at_the_end_of_its_shutdown_timeout_are_counted():
    """Issue 27, item 6: a save that overran stop_grace (torchrun's shutdown timeout) is named."""
    from orchestrator.job.reports import overran
    p = FailureReportParser()
    for text in ("W1124 05:32:21.234000 13158 api.py:1028] Sending process 13178 closing signal SIGTERM",
                 "W1124 05:32:23.301000 13158 api.py:1047] Unable to shutdown process 13178 via Signals.SIGTERM, "
                 "forcefully exiting via Signals.SIGKILL"):
        p.feed(text)
    assert p.forced == 1
    assert overran("interrupted (SIGINT)", p.forced, 2.0) == \
        "interrupted (SIGINT); 1 process(es) killed at the end of stop_grace (2 s): a save took longer?"
    assert overran("interrupted (SIGINT)", 0, 2.0) == "interrupted (SIGINT)"


def test_stack_report_skips_ddp_ups_recorder_thread():
    """Issue 28: faulthandler dumps every thread; the Flight Recorder's thread (node/watch/flight.py)
    may come first, and is not where the rank is."""
    from orchestrator.diagnose.logparse import StackReport

    r = StackReport()
    for rank in range(2):
        dump(r, rank, [("/tmp/ddp-up-0/j/node0/hooks/sitecustomize.py", "record"), ("/usr/lib/threading.py", "run")])
        dump(r, rank, [(C10D, "all_reduce"), (LOGGER, "wrapper"), ("/job/train.py", "step")] if rank else
             [("/job/data.py", "load_batch")])
    assert r.odd_ones_out() == [0] and r.describe(1) == "in all_reduce (from step)"


def test_a_rank_stuck_in_ddps_bucket_rebuild_is_in_a_collective():
    """Accelerate's test_distributed_data_loop.py (uneven inputs, gloo on CPU, torch 2.13): rank 0
    waits in DDP's _rebuild_buckets (a broadcast), rank 1 in a barrier. Both are in collectives;
    rank 0 read as "not in a collective" before DDP's own frames counted. (The Flight Recorder's
    paragraph for the same hang: "at #5 the ranks called different collectives: rank 0 broadcast
    [3] Int; rank 1 barrier".)"""
    from pathlib import Path

    from orchestrator.diagnose.logparse import StackReport

    data = Path(__file__).resolve().parents[1] / "data" / "ddp_join_hang"
    report = StackReport()
    for rank in (0, 1):
        for line in (data / f"rank{rank}.stack.txt").read_text().splitlines():
            report.feed(rank, line)
    assert report.describe(0) == "in DistributedDataParallel._pre_forward (from test_can_join_uneven_inputs)"
    assert report.describe(1) == "in barrier (from PartialState.wait_for_everyone)"  # the innermost frame outside torch
    assert "rank 0 (a) broadcast [3] Int; rank 1 (b) barrier" in (data / "rank0.collectives.json").read_text()


def test_the_nodes_reader_takes_torchruns_report_in_pieces_of_any_size():
    """A detached job's agent reads the rank's exit code from the launcher's relayed output with
    the controller's own parser (torchrun's own code is 1 for any rank)."""
    from orchestrator.node.watch.report import ReportReader

    report = (b"[W] some warning\nFailures:\n  <NO_OTHER_FAILURES>\n----\nRoot Cause (first observed failure):\n"
              b"[0]:\n  time      : 2026-11-27_06:00:00\n  host      : n1\n  rank      : 1 (local_rank: 0)\n"
              b"  exitcode  : 3 (pid: 99)\n  error_file: <N/A>\n=====\n")
    for size in (1, 7, 64, len(report)):
        reader = ReportReader()
        for at in range(0, len(report), size):
            reader.feed(report[at:at + size])
        assert reader.rank_code() == 3, size
    reader = ReportReader()
    reader.feed(b"x" * 100_000)  # one endless line: passed over, memory bounded
    assert reader.rank_code() is None and len(reader.partial) <= ReportReader.LINE_MOST


def test_the_launchers_own_exception_is_the_last_line_of_its_last_traceback():
    p = FailureReportParser()
    for line in ["[W] some warning: Error in the text, not an exception", "ValueError: not after a traceback",
                 "Traceback (most recent call last):", '  File "x.py", line 1, in <module>',
                 "KeyError: 'a'", "", "During handling of the above exception, another exception occurred:", "",
                 "Traceback (most recent call last):", '  File "run.py", line 9, in main',
                 "    raise DistNetworkError(msg)",
                 "torch.distributed.DistNetworkError: The server socket has failed to listen. name: EADDRINUSE",
                 "ValueError: after the traceback's end"]:
        p.feed(line)
    assert p.exception == "torch.distributed.DistNetworkError: The server socket has failed to listen. name: EADDRINUSE"
    bare = FailureReportParser()
    for line in ["Traceback (most recent call last):", "  x", "KeyboardInterrupt"]:
        bare.feed(line)
    assert bare.exception == "KeyboardInterrupt"
    long = FailureReportParser()
    for line in ["Traceback (most recent call last):", "RuntimeError: " + "x" * 5000]:
        long.feed(line)
    assert len(long.exception) == 500
