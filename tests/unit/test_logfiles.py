import json

from orchestrator.clusterfile import parse_cluster
from orchestrator.events import LogLine
from orchestrator.outcome import JobResult, NodeStatus
from orchestrator.plan import make_plan
from orchestrator.views.logfiles import RunLogs


def test_every_line_lands_in_node_and_rank_files_and_summary(tmp_path):
    plan = make_plan(parse_cluster("nodes: [{host: a, gpus: 2}, {host: 'b:c', gpus: 1}]\n"), "t.py", ["x"], "J", "/")
    logs = RunLogs(plan, str(tmp_path), wall=lambda: 1.8e9)
    logs.lines(plan.nodes[0], [LogLine("out", 0, "zero"), LogLine("err", 1, "one"), LogLine("out", None, "torchrun")])
    logs.lines(plan.nodes[1], [LogLine("out", 2, "two"), LogLine("node", None, "shell noise")])
    statuses = [NodeStatus(plan.nodes[0], state="done", exit_code=0, lines=3),
                NodeStatus(plan.nodes[1], state="done", exit_code=0, lines=2)]
    logs.finished(JobResult(plan, statuses, 29500, []))
    d = tmp_path / "J"
    assert (d / "node0-a.log").read_text() == "r0 | zero\nr1 ! one\n- | torchrun\n"
    assert (d / "node1-b_c.log").read_text() == "r2 | two\n- ~ shell noise\n"
    assert [(d / f"rank{r}.log").read_text() for r in range(3)] == ["zero\n", "one\n", "two\n"]
    summary = json.loads((d / "summary.json").read_text())
    assert summary["exit_code"] == 0 and summary["world_size"] == 3 and summary["root_cause"] is None
    assert [(n["host"], n["ranks"], n["state"], n["lines"]) for n in summary["nodes"]] == [
        ("a", [0, 1], "done", 3), ("b:c", [2, 2], "done", 2)]
