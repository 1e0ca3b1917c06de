import json

from orchestrator.config.clusterfile import parse_cluster
from orchestrator.job.events import LogLine
from orchestrator.diagnose.outcome import JobResult, NodeStatus
from orchestrator.plan.launch import make_plan
from orchestrator.views.logfiles import RunLogs


def test_every_line_lands_in_node_and_rank_files_and_summary(tmp_path):
    plan = make_plan(parse_cluster("nodes: [{host: a, gpus: 2}, {host: 'b:c', gpus: 1}]\n"), "t.py", ["x"], "J", "/")
    logs = RunLogs(plan, str(tmp_path), wall=lambda: 1.8e9)
    logs.lines(plan.nodes[0], [LogLine("out", 0, "zero"), LogLine("err", 1, "one"), LogLine("out", None, "torchrun")])
    logs.lines(plan.nodes[1], [LogLine("out", 2, "two"), LogLine("node", None, "shell noise")])
    statuses = [NodeStatus(plan.nodes[0], state="done", exit_code=0, lines=3),
                NodeStatus(plan.nodes[1], state="done", exit_code=0, lines=2)]
    logs.finished(JobResult(plan, tuple(s.outcome() for s in statuses), 29500, []))
    d = tmp_path / "J"
    assert (d / "node0-a.log").read_text() == "r0 | zero\nr1 ! one\n- | torchrun\n"
    assert (d / "node1-b_c.log").read_text() == "r2 | two\n- ~ shell noise\n"
    assert [(d / f"rank{r}.log").read_text() for r in range(3)] == ["zero\n", "one\n", "two\n"]
    summary = json.loads((d / "summary.json").read_text())
    assert summary["exit_code"] == 0 and summary["world_size"] == 3 and summary["root_cause"] is None
    assert [(n["host"], n["ranks"], n["state"], n["lines"]) for n in summary["nodes"]] == [
        ("a", [0, 1], "done", 3), ("b:c", [2, 2], "done", 2)]


def test_a_planted_link_in_a_shared_runs_directory_is_never_written_through(tmp_path):
    """Issue 26, item 6: a runs/ directory other users can write into may hold links planted where
    the run's files go; ddp-attach/ddp-logs rewrite them whole (fresh), ddp-up appends. Neither
    writes through a link: a planted file link is replaced (fresh) or refused (append), a planted
    directory link is refused; the targets are untouched."""
    import os

    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    runs = tmp_path / "runs"
    plan = make_plan(parse_cluster("nodes: [{host: a, gpus: 1}]\n"), "t.py", [], "J", "/")
    (runs / "J").mkdir(parents=True)
    for name in ("rank0.log", "node0-a.log", ".summary.json.tmp"):
        os.symlink(victim, runs / "J" / name)
    fresh = RunLogs(plan, str(runs), wall=lambda: 1.8e9, fresh=True)
    fresh.lines(plan.nodes[0], [LogLine("out", 0, "replayed")])
    fresh.finished(JobResult(plan, (NodeStatus(plan.nodes[0], state="done", exit_code=0, lines=1).outcome(),), 29500, []))
    assert victim.read_text() == "keep me\n"
    assert (runs / "J" / "rank0.log").read_text() == "replayed\n" and not (runs / "J" / "rank0.log").is_symlink()
    assert json.loads((runs / "J" / "summary.json").read_text())["exit_code"] == 0

    os.unlink(runs / "J" / "rank0.log")
    os.symlink(victim, runs / "J" / "rank0.log")
    warned: list[str] = []
    appending = RunLogs(plan, str(runs), wall=lambda: 1.8e9, warn=warned.append)
    appending.lines(plan.nodes[0], [LogLine("out", 0, "live")])
    appending.close()
    assert victim.read_text() == "keep me\n" and len(warned) == 1  # refused, said once; the job goes on

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, runs / "K")
    other = make_plan(parse_cluster("nodes: [{host: a, gpus: 1}]\n"), "t.py", [], "K", "/")
    warned.clear()
    logs = RunLogs(other, str(runs), wall=lambda: 1.8e9, warn=warned.append)
    logs.lines(other.nodes[0], [LogLine("out", 0, "x")])
    logs.close()
    assert not any(elsewhere.iterdir()) and warned and "symbolic link" in warned[0]


def test_no_line_lands_inside_another_that_arrives_in_pieces(tmp_path, monkeypatch):
    """Issue 26, item 3: a rank's 3 MB stdout line arrives in pieces; its stderr line (and another
    rank's line) arriving between them used to land inside it, in the rank log and the node log."""
    from orchestrator.views import logfiles

    plan = make_plan(parse_cluster("nodes: [{host: a, gpus: 2}]\n"), "t.py", [], "J", "/")
    logs = RunLogs(plan, str(tmp_path), wall=lambda: 1.8e9)
    piece = "x" * (1 << 20)
    logs.lines(plan.nodes[0], [LogLine("out", 0, "before"), LogLine("out", 0, piece, True)])
    logs.lines(plan.nodes[0], [LogLine("err", 0, "warning: slow"), LogLine("out", 1, "rank 1 step"),
                               LogLine("out", 0, piece, True)])
    logs.lines(plan.nodes[0], [LogLine("out", 0, piece + "end"), LogLine("err", 0, "after")])
    logs.close()
    d = tmp_path / "J"
    assert (d / "rank0.log").read_text().splitlines() == ["before", piece * 3 + "end", "warning: slow", "after"]
    assert (d / "rank1.log").read_text() == "rank 1 step\n"
    assert (d / "node0-a.log").read_text().splitlines() == [
        "r0 | before", "r0 | " + piece * 3 + "end", "r0 ! warning: slow", "r1 | rank 1 step", "r0 ! after"]

    # what waits is bounded: past HOLD_MOST, the unfinished line is ended where it is
    monkeypatch.setattr(logfiles, "HOLD_MOST", 10)
    logs = RunLogs(plan, str(tmp_path / "bounded"), wall=lambda: 1.8e9)
    logs.lines(plan.nodes[0], [LogLine("out", 0, "open", True)] + [LogLine("err", 0, f"e{i}") for i in range(6)])
    logs.lines(plan.nodes[0], [LogLine("out", 0, "rest")])
    logs.close()
    assert (tmp_path / "bounded" / "J" / "rank0.log").read_text().splitlines() == [
        "open", "e0", "e1", "e2", "e3", "e4", "e5", "rest"]

    # the unterminated end of a rank's output stays unterminated; what waited for it follows
    logs = RunLogs(plan, str(tmp_path / "ends"), wall=lambda: 1.8e9)
    logs.lines(plan.nodes[0], [LogLine("out", 0, "no newline", True)])
    logs.lines(plan.nodes[0], [LogLine("out", 1, "last", True)])
    logs.close()
    assert (tmp_path / "ends" / "J" / "rank0.log").read_text() == "no newline"
    assert (tmp_path / "ends" / "J" / "node0-a.log").read_text() == "r0 | no newline\nr1 | last"


def test_a_replayed_bar_leaves_a_snapshot_every_10_s_of_its_own_time_not_of_the_replays(tmp_path):
    """ddp-attach and ddp-logs replay a detached job's journal in a moment: thinned by the
    replay's clock, a 40 s bar left one line in rank0.log; by the time the node recorded each, one
    every 10 s, as a foreground run keeps."""
    from orchestrator.diagnose.progress import Bar

    plan = make_plan(parse_cluster("nodes: [{host: a, gpus: 1}]\n"), "t.py", [], "J", "/")
    logs = RunLogs(plan, str(tmp_path), wall=lambda: 1.8e9)  # the replay runs now, at one instant
    for second in range(0, 41, 2):
        logs.bars(plan.nodes[0], [Bar("err", 0, (f"epoch 1: {second}/40", "val: 0/2"))], at=1.7e9 + second)
    logs.finished(JobResult(plan, (NodeStatus(plan.nodes[0], state="done", exit_code=0).outcome(),), 29500, []))
    lines = (tmp_path / "J" / "rank0.log").read_text().splitlines()
    assert [line for line in lines if line.startswith("epoch")] == [f"epoch 1: {s}/40" for s in (0, 10, 20, 30, 40)]
    assert lines.count("val: 0/2") == 5  # a bar's rows, each a line of its own
