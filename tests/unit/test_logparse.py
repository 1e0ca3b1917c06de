from orchestrator.logparse import FailureReportParser, split_rank

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


def test_split_rank():
    assert split_rank("\x1d12\x1dloss 0.5") == (12, "loss 0.5")
    assert split_rank("\x1d3\x1d") == (3, "")
    assert split_rank("plain launcher line") == (None, "plain launcher line")
    assert split_rank("\x1dnot a rank") == (None, "\x1dnot a rank")


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
