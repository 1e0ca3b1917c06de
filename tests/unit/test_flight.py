"""Issue 28: the Flight Recorder's records, read on the node and on the controller: the stuck
collective named, a mismatch named, stragglers told from a balanced job, hostile records survived."""

from __future__ import annotations

import json
import os
import random

import pytest

from orchestrator.diagnose import collective, flight
from orchestrator.job.hang import HangWatch
from orchestrator.node.watch import flight as node_flight
from orchestrator.node.protocol.stragglers import LEAST, LateWatch

NS = 1_795_506_773_000_000_000


def fr_entry(seq, op="all_reduce", done=True, sizes=((4,),), group=("0", "default_pg"), called=0.0):
    """One entry as torch 2.13's _dump_fr_trace_json writes it (gloo)."""
    return {"collective_seq_id": seq, "input_dtypes": ["Float"], "input_sizes": [list(s) for s in sizes],
            "is_p2p": False, "op_id": seq, "output_dtypes": ["Float"], "output_sizes": [list(s) for s in sizes],
            "p2p_seq_id": 0, "pg_id": 0, "process_group": list(group), "profiling_name": f"gloo:{op}",
            "record_id": seq - 1, "retired": done, "state": "scheduled", "thread_id": "1", "thread_name": "python3",
            "time_created_ns": NS + int(called * 1e9), "time_discovered_completed_ns": 0,
            "time_discovered_started_ns": 0, "timeout_ms": 1800000}


def records(by_rank: dict) -> dict:
    """{rank: [fr entries]} through both ends: the node's compact form, then the controller's check."""
    frame = {str(r): [node_flight.compact(e) for e in es] for r, es in by_rank.items()}
    return flight.parse(frame, range(len(by_rank)))


def where(rank: int) -> str:
    return f"node{rank // 2}"


def test_a_rank_that_never_entered_the_collective_is_named_with_its_number():
    found = records({r: [fr_entry(1), fr_entry(2)] + ([] if r == 5 else [fr_entry(3, done=False)]) for r in range(8)})
    d = flight.diagnose(found, where, 8)
    assert d.text == ("Flight Recorder: on the default group, every rank completed all_reduce #2; rank 5 (node2) never "
                      "entered all_reduce #3; ranks 0-4, 6-7 wait in it.")
    assert d.blamed == ((5,), "never entered all_reduce #3 on the default group")


def test_a_mismatch_at_one_sequence_number_is_named():
    found = records({0: [fr_entry(4), fr_entry(5, done=False)], 1: [fr_entry(4), fr_entry(5, "all_gather", False)],
                     2: [fr_entry(4), fr_entry(5, done=False)]})
    d = flight.diagnose(found, where, 3)
    assert "at #5 the ranks called different collectives: ranks 0, 2 (node0) all_reduce [4] Float; " \
           "rank 1 (node0) all_gather [4] Float" in d.text, d.text
    assert d.blamed == ((1,), "called all_gather #5 on the default group where the others called all_reduce")
    sizes = records({0: [fr_entry(5, done=False)], 1: [fr_entry(5, done=False, sizes=((8,),))]})
    assert "[4] Float; rank 1 (node0) all_reduce [8] Float" in flight.diagnose(sizes, where).text
    assert flight.diagnose(sizes, where).blamed is None  # one against one: no telling which is odd


def test_no_stuck_collective_says_so_and_names_ranks_without_a_record():
    d = flight.diagnose(records({0: [fr_entry(1)], 1: [fr_entry(1)]}), where, 3)
    assert d.text == ("Flight Recorder: on the default group, every rank completed all_reduce #1; no rank waits in a "
                      "collective (the hang is elsewhere: see the stacks); no record from rank 2.")
    assert flight.diagnose({}, where) is None


def test_a_subgroup_is_named_and_the_stuck_one_comes_first():
    sub = ("3", "tp_group")
    found = records({0: [fr_entry(2), fr_entry(1, group=sub), fr_entry(2, group=sub, done=False)],
                     1: [fr_entry(2), fr_entry(1, group=sub)]})
    assert flight.diagnose(found, where).text.startswith(
        "Flight Recorder: on group 3 (tp_group), every rank completed all_reduce #1; rank 1 (node0) never entered")


def test_hostile_entries_are_dropped_and_names_cleaned():
    raw = {"0": [["0", "\x1b]0;pwned\x07", 1, "\x1b[31mall_reduce", False, [], [], [], [], None],
                 ["0", "x", True, "op", True, [], [], [], [], None], ["0", "x", 2 ** 70, "op", True, [], [], [], [], 1],
                 ["0", "x", 1, "op", "yes", [], [], [], [], 1], ["a"] * 10, "no", None, 5],
           "1": "nope", "7": [["0", "x", 1, "op", True, [], [], [], [], 1]], "-1": [], "x": []}
    found = flight.parse(raw, range(2))
    assert list(found) == [0] and len(found[0]) == 1  # rank 7 is not this node's
    assert "\x1b" not in found[0][0].desc + found[0][0].op and "\x07" not in found[0][0].desc
    assert flight.parse(["not a dict"], range(2)) == {}


def test_the_node_reads_records_as_json_only_and_bounded(tmp_path):
    good = {"entries": [fr_entry(1), fr_entry(2, done=False), {"is_p2p": True}, "junk", fr_entry(3) | {"process_group": 5}]}
    (tmp_path / "fr.0.json").write_text(json.dumps(good))
    (tmp_path / "fr.1.json").write_bytes(b"\x80\x04pickle, not json")
    (tmp_path / "fr.2.json").write_text(" " * (node_flight.RECORD_MAX + 1))
    os.symlink(tmp_path / "fr.0.json", tmp_path / "fr.3.json")  # never through a link
    (tmp_path / "nccl.0.json").write_text(json.dumps({"entries": [fr_entry(7, group=("1", "nccl"))]}))
    (tmp_path / "other.json").write_text(json.dumps(good))
    found = node_flight.read_records(str(tmp_path))
    assert list(found) == [0]
    assert [(e[0], e[2], e[4]) for e in found[0]] == [("0", 1, True), ("0", 2, False), ("1", 7, True)]
    assert node_flight.read_records(str(tmp_path / "absent")) == {}


def test_the_users_own_buffer_settings_are_kept():
    mine = node_flight.recording_env({"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}, "/d")
    assert mine["TORCH_FR_BUFFER_SIZE"] == "2000" and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in mine
    assert mine["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0" and mine[node_flight.DIR_VAR] == "/d"
    ours = node_flight.recording_env({}, "/d")
    assert ours["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"].startswith("/d/")  # never /tmp's shared name


@pytest.mark.parametrize("torch, var", [("2.13.0", "TORCH_FR_BUFFER_SIZE"), ("2.11.0+cu130", "TORCH_FR_BUFFER_SIZE"),
                                        ("2.9.0", "TORCH_FR_BUFFER_SIZE"), ("10.1", "TORCH_FR_BUFFER_SIZE"),
                                        (None, "TORCH_FR_BUFFER_SIZE"), ("?", "TORCH_FR_BUFFER_SIZE"),
                                        ("2.8.1", "TORCH_NCCL_TRACE_BUFFER_SIZE"), ("1.13.1", "TORCH_NCCL_TRACE_BUFFER_SIZE")])
def test_only_the_buffer_variable_the_nodes_torch_reads_is_set(torch, var):
    """Both names set made torch 2.11 (NCCL, on an H200) and 2.13 (gloo) warn in every rank that the
    old one is deprecated; the new one alone records (tests/data/gpu/h200/fr-vars-*.txt)."""
    env = node_flight.recording_env({}, "/d", torch)
    assert [v for v in node_flight.BUFFER_VARS if v in env] == [var] and env[var] == node_flight.BUFFER


def test_arrivals_wait_until_every_rank_of_the_node_called_the_collective():
    watch = node_flight.ArrivalWatch(2)
    r0 = [node_flight.compact(fr_entry(s, called=s)) for s in (1, 2)]
    r1 = [node_flight.compact(fr_entry(1, called=1.3))]
    frame = watch.arrivals({0: r0, 1: r1})
    assert [t[:2] + [t[3]] for t in frame.times] == [["0", 1, 1]]  # #2: rank 1 has not called it yet
    assert abs(frame.times[0][2] - (NS / 1e9 + 1.3)) < 1e-6
    r1.append(node_flight.compact(fr_entry(2, called=2.1)))
    assert [t[1] for t in watch.arrivals({0: r0, 1: r1}).times] == [2]  # #1 was sent: not again
    assert watch.arrivals({0: r0}) is None


def late_watch(nodes: int, late_node: int | None, count: int, seed: int = 1) -> LateWatch:
    rng = random.Random(seed)
    watch = LateWatch(nodes)
    for seq in range(count):
        for node in range(nodes):
            t = seq + rng.uniform(0, 0.02) + (0.3 if node == late_node else 0.0)
            watch.arrivals(node, [["0", seq, t, node * 2 + 1]], float)
    return watch


def test_a_node_late_at_most_collectives_is_a_straggler_and_no_one_else():
    for nodes in (2, 4):
        watch = late_watch(nodes, nodes - 1, 40)
        figures = watch.figures()
        assert [f.node for f in figures if f.straggler] == [nodes - 1]
        late = figures[nodes - 1]
        assert 0.28 < late.late < 0.32 and late.rank == 2 * nodes - 1 and late.text().endswith(" ms at 100% of collectives")
        assert watch.marks() == {nodes - 1: late.text()}


def test_a_balanced_job_has_no_straggler():
    for seed in range(20):
        assert not any(f.straggler for f in late_watch(4, None, 200, seed).figures())


def test_a_straggler_is_announced_once_and_not_before_enough_collectives():
    watch = LateWatch(2)
    told = []
    for seq in range(30):
        told += watch.arrivals(1, [["0", seq, seq + 0.2, 1]], float)
        told += watch.arrivals(0, [["0", seq, seq, 0], ["bad"], ["0", "x", 1, 1], "no"], float)
        if seq < LEAST - 1:
            assert not told
    assert [f.node for f in told] == [1]


def test_the_probe_reports_lateness_in_the_same_words():
    paces = [[0.01] * 20, [0.01] * 20, [0.25] * 20]
    figures = collective.lateness({"world": 3, "arrivals": paces})
    assert [f.straggler for f in figures] == [False, False, True]
    assert figures[2].text() == "late 240 ms at 100% of collectives"
    assert collective.lateness({"world": 3}) == []


def test_a_hang_names_the_rank_the_records_blame_over_the_stacks():
    from orchestrator.diagnose import outcome

    def node(index, ranks):
        return outcome.NodeStatus(type("NodePlan", (), {"index": index, "ranks": ranks})(), state="running")

    statuses = [node(0, range(0, 2)), node(1, range(2, 4))]
    for blamed, rank, says in ((lambda: ((3,), "never entered all_reduce #3 on the default group"), 3,
                                "rank 3 never entered all_reduce #3 on the default group (Flight Recorder); "),
                               (lambda: None, 0, "quietest ranks first")):
        watch = HangWatch(60, "J1")
        watch.started(0.0)
        watch.ranks_up(range(4), 0.0)
        assert watch.check(61.0, statuses, stopping=False)
        hung = watch.check(61.0 + 10, statuses, stopping=False, blamed=blamed)
        assert hung.rank == rank and hung.node == rank // 2 and says in hung.what, hung


def test_a_400_digit_time_is_no_time_and_the_arrival_watch_goes_on():
    entry = fr_entry(1) | {"time_created_ns": 10 ** 400}
    assert node_flight.compact(entry)[9] is None
    watch = node_flight.ArrivalWatch(1)
    assert watch.arrivals({0: [node_flight.compact(entry), node_flight.compact(fr_entry(2, called=1.0))]}) is not None


def test_a_rank_that_merely_prints_timed_out_does_not_make_another_failure_a_collectives_one():
    from orchestrator.job.events import LogLine
    from orchestrator.diagnose.outcome import Failure

    log = flight.FlightLog(nodes=1, world=4)
    log.collectives({str(r): [node_flight.compact(fr_entry(1)), node_flight.compact(fr_entry(2, done=r != 3))]
                     for r in range(4)}, range(4))
    log.lines([LogLine("err", 3, "retrying: Timed out waiting 5000ms for the data server")])
    unrelated = Failure(0, "a", 1, 1, "rank 1 exited with code 1", 5.0, "ValueError: bad batch")
    assert log.diagnosis([unrelated], str) is None
    own = Failure(0, "a", 3, 1, "rank 3 exited with code 1", 5.0, "RuntimeError: something")
    assert log.diagnosis([own], str) is not None  # the rank that said it is the one that failed


DUMP = (b"step 7 done\n"
        b"Thread 0x00007f3d5962f6c0 (most recent call first):\n"
        b'  File "/tmp/ddp-up-0/J/node0/hooks/sitecustomize.py", line 9 in record\n'
        b'  File "/usr/lib/python3.11/threading.py", line 982 in run\n'
        b'  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap\n'
        b"\n"
        b"Thread 0x00007f3d5a000000 (most recent call first):\n"
        b'  File "/job/data.py", line 40 in load\n'
        b"\n"
        b"Current thread 0x00007f3d5a46fb80 (most recent call first):\n"
        b'  File "/x/torch/distributed/distributed_c10d.py", line 1 in all_reduce\n'
        b'  File "/job/train.py", line 9 in step\n'
        b"Thread 0x12 is what the user printed\n")
SHOWN = DUMP.replace(DUMP[DUMP.index(b"Thread 0x00007f3d5962f6c0"):DUMP.index(b"Thread 0x00007f3d5a000000")], b"")


def test_the_stacks_a_user_is_shown_leave_out_ddp_ups_own_recorder_thread():
    """faulthandler dumps every thread, ddp-up's Flight Recorder thread too: its block is dropped,
    whatever pieces the dump arrives in; the rank's own threads and lines pass as they were."""
    from orchestrator.node.watch.flight import RecorderFilter

    for size in (1, 2, 5, 17, 64, len(DUMP)):
        ours, out = RecorderFilter(), b""
        for at in range(0, len(DUMP), size):
            out += ours.feed(DUMP[at:at + size])
        assert out + ours.flush() == SHOWN, size
    plain = b"no dump here\n" * 3 + b"a partial line"
    assert RecorderFilter().feed(plain) is plain  # the common case: passed as it is


def test_a_py_spy_dump_leaves_out_the_recorder_thread_by_its_name():
    from orchestrator.node.watch.flight import without_recorder

    spy = (b"ddp-up: py-spy dump of pid 7 (rank 1)\n"
           b'Thread 7 (idle): "MainThread"\n    all_reduce (torch/distributed/distributed_c10d.py:1)\n'
           b'Thread 9 (idle): "ddp-up-flight-recorder"\n    record (sitecustomize.py:9)\n    run (threading.py:982)\n'
           b'Thread 11 (active): "loader"\n    load (data.py:40)\n')
    assert without_recorder(spy) == spy.replace(b'Thread 9 (idle): "ddp-up-flight-recorder"\n    record '
                                                b'(sitecustomize.py:9)\n    run (threading.py:982)\n', b"")
