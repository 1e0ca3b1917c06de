"""The run's timeline (views/timeline.py): bounded series, the file's lines, secrets masked, a
file without its end when the run did not end; and the report page's text escaped (report.py)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

from orchestrator.config.clusterfile import parse_cluster
from orchestrator.diagnose.progress import Bar
from orchestrator.job.events import LogLine
from orchestrator.node.protocol.stragglers import Lateness
from orchestrator.plan.launch import make_plan
from orchestrator.views import timeline
from orchestrator.views.report import load, render


class Wall:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def test_a_series_keeps_at_most_its_points_and_the_means_of_what_it_merged():
    s = timeline.Series()
    for i in range(86_400 // 5):  # a day, a sample every 5 s: the value is the hour
        s.add(1000.0 + i * 5, (i * 5) // 3600)
    points = s.points(1000.0)
    assert len(points) <= timeline.POINTS and s.step >= 86_400 / timeline.POINTS
    assert points[0][1] == 0 and points[-1][1] == 23 and [p[1] for p in points] == sorted(p[1] for p in points)
    counts = timeline.Series(total=True)  # lines: so many a bucket, shown per second
    for i in range(100):
        counts.add(i * 0.5, 3)  # 6 lines a second
    assert {p[1] for p in counts.points(0.0)} == {6.0}


def test_the_timeline_keeps_each_kind_masks_secrets_and_ends_only_with_the_run(tmp_path):
    wall = Wall()
    plan = make_plan(parse_cluster("env: {TOKEN: hunter2-secret}\nsecrets: [TOKEN]\n"
                                   "nodes: [{host: a, gpus: 2}, {host: b, gpus: 2}]\n"), "t.py", [], "J1", "/tmp")
    kept = timeline.Timeline(str(tmp_path), plan, wall=wall)
    node = plan.nodes[1]
    wall.now += 3
    kept.node_state(SimpleNamespace(plan=node, state="running", reason=None))
    kept.lines(node, [LogLine("out", 2, "x"), LogLine("out", 2, "y", more=True), LogLine("out", 3, "z")])
    kept.bars(node, [Bar("err", 2, ("train hunter2-secret: 40%|####  | 4/10 [00:02<00:03, 2.00it/s]",))])
    kept.gpus(node, [[0, 87, 61000, 81559], ["odd"], [1, "x", 1, 2]])
    kept.late([Lateness(1, 20, 18, 0.180, 3)])
    kept.close()
    lines = [json.loads(x) for x in (tmp_path / timeline.NAME).read_text().splitlines()]
    kinds = [x["kind"] for x in lines]
    assert kinds[0] == "run" and "end" not in kinds  # closed, not finished: cut short
    states = [(x["t"], x["node"], x["state"]) for x in lines if x["kind"] == "state"]
    assert states == [(0.0, "a", "connecting"), (0.0, "b", "connecting"), (3.0, "b", "running")]
    by = {(x["kind"], x.get("rank"), x.get("node"), x.get("gpu")): x for x in lines}
    assert by[("lines", 2, "b", None)]["points"] == [[3.0, 0.5]] and by[("lines", 3, "b", None)]["points"] == [[3.0, 0.5]]
    progress = by[("progress", 2, "b", None)]
    assert progress["points"] == [[3.0, 4.0, 2.0]] and progress["total"] == 10
    assert "hunter2-secret" not in json.dumps(lines) and "***" in progress["desc"]
    assert by[("gpu", None, "b", 0)]["points"] == [[3.0, 87.0, 61000.0]] and by[("gpu", None, "b", 0)]["total_mib"] == 81559
    assert by[("late", None, "b", None)]["points"] == [[3.0, 180.0]]
    assert oct(os.stat(tmp_path / timeline.NAME).st_mode & 0o777) == "0o600"

    wall.now += 2
    kept.finished(SimpleNamespace(exit_code=1), attempts=[SimpleNamespace(number=0, ended=wall.now, end="failed",
                                                                          root_cause="b (node 1, rank 2) failed", next=None)])
    lines = [json.loads(x) for x in (tmp_path / timeline.NAME).read_text().splitlines()]
    assert lines[-1] == {"kind": "end", "t": 5.0, "exit_status": 1}
    assert {x["kind"]: x for x in lines}["attempt"] == {
        "kind": "attempt", "attempt": 0, "start": 0.0, "end": 5.0, "nodes": ["a", "b"], "world_size": 4,
        "end_why": "failed", "cause": "b (node 1, rank 2) failed", "next": None}


def test_the_page_escapes_what_came_from_the_run(tmp_path):
    """The page's own text (the root cause, a traceback, a host, the command) is escaped; a chart's
    labels too (Plotly reads a few tags in them); Plotly writes its data with < > / escaped."""
    evil = "</script><script>alert(1)</script>"
    (tmp_path / "summary.json").write_text(json.dumps({
        "exit_code": 1, "root_cause": {"host": evil, "node": 0, "rank": 0, "what": evil, "exception": evil,
                                       "traceback": [evil, "  File x"]}, "nodes": [{"node": 0, "host": evil}]}))
    (tmp_path / "run.json").write_text(json.dumps({"command": ["ddp-up", evil]}))
    (tmp_path / timeline.NAME).write_text("\n".join(json.dumps(x) for x in (
        {"kind": "state", "t": 0, "node": evil, "state": "running", "reason": evil},
        {"kind": "progress", "rank": 0, "node": evil, "desc": evil, "unit": evil, "points": [[1, 2, 3], [2, 3, 4]]},
        {"kind": "end", "t": 3, "exit_status": 1})))
    with open(tmp_path / timeline.NAME, "a") as f:  # damaged lines: left out, counted, the rest drawn
        f.write('\n{"kind": "state", "t": "soon"}\n{"kind": "lines", "points": [["x", 1]]}\n[1, 2]\n{"kind"')
    data = load(str(tmp_path))
    assert "4 damaged line(s) of timeline.jsonl, left out" in data.missing and len(data.records) == 3
    page = render(data)
    assert evil not in page and "<script>alert" not in page
    assert page.count("&lt;/script&gt;&lt;script&gt;alert(1)") >= 5  # the page's text, shown as it was


def test_the_page_has_a_chart_for_each_kind_kept_the_traceback_and_what_a_lost_node_left_out(tmp_path):
    from orchestrator.views.charts import figures
    from orchestrator.views.rundata import load

    (tmp_path / "summary.json").write_text(json.dumps({"exit_code": 1, "root_cause": {
        "host": "b", "node": 1, "rank": 2, "what": "exited with code 1", "exception": "ValueError: bad batch",
        "traceback": ["Traceback (most recent call last):", '  File "train.py", line 9, in <module>']}}))
    (tmp_path / timeline.NAME).write_text("\n".join(json.dumps(x) for x in (
        {"kind": "state", "t": 0, "node": "a", "attempt": 0, "state": "running", "reason": None},
        {"kind": "state", "t": 5, "node": "b", "attempt": 0, "state": "lost", "reason": "no word for 30 s"},
        {"kind": "progress", "rank": 0, "node": "a", "desc": "d", "points": [[1, 2, 3.0], [2, 3, 1.0]]},
        {"kind": "progress", "rank": 1, "node": "a", "desc": "d", "points": [[1, 2, 5.0], [2, 3, 6.0]]},
        {"kind": "gpu", "node": "a", "gpu": 0, "total_mib": 80000, "points": [[1, 90, 7000], [2, 95, 7100]]},
        {"kind": "late", "node": "b", "points": [[1, 0.0], [2, 180.0]]},
        {"kind": "end", "t": 6, "exit_status": 1})))
    data = load(str(tmp_path))
    made = dict(figures(data))
    assert set(made) == {"timeline", "rate", "gpu-util", "gpu-memory", "late"}  # no lines kept: no chart of them
    assert [t.y for t in made["gpu-memory"].data] == [(7000, 7100)] and [t.y for t in made["late"].data] == [(0.0, 180.0)]
    assert "slowest rank 0 on a, median 2/s" in made["rate"].layout.title.text
    assert data.missing == ["run.json: missing", "b: lost at 5 s (attempt 0); nothing of it after that in that attempt"]
    page = render(data)
    assert "ValueError: bad batch" in page and "File &quot;train.py&quot;, line 9" in page


def test_the_page_says_what_nvidia_smi_said_of_each_gpu_at_the_preflight(tmp_path):
    """An H100's real answer (tests/data/gpu/health/h100), through the run logs' summary to the page."""
    from pathlib import Path

    from orchestrator.node.probes.gpuhealth import parse_health
    from orchestrator.views.logfiles import RunLogs, summary_of

    plan = make_plan(parse_cluster("nodes: [{host: gpu-a, gpus: 1}]\n"), "t.py", [], "J1", "/tmp")
    health = parse_health((Path(__file__).parents[1] / "data" / "gpu" / "health" / "h100" / "smi-health.csv").read_text())
    logs = RunLogs(plan, str(tmp_path))
    logs.node_state(SimpleNamespace(plan=plan.nodes[0], state="ready", terminal=False, rank_errors=[],
                                    info={"python": "3.11", "gpu_health": health}))
    node = summary_of(logs, SimpleNamespace(root_cause=None, lateness=(), master_text="a:1", interrupted=None,
                                            nodes=[], collectives=None, started=None, ended=None), 0)
    (tmp_path / "summary.json").write_text(json.dumps(dict(node, nodes=[{"node": 0, "host": "gpu-a",
                                                                          **logs.node_versions[0]}])))
    page = render(load(str(tmp_path)))
    assert "GPUs at the preflight" in page and "NVIDIA H100 80GB HBM3" in page and "PCIe gen 5 x16" in page, page[-3000:]


def test_ddp_report_makes_a_runs_page_again_and_names_what_it_cannot(tmp_path, capsys):
    from orchestrator.commands.report import main_report

    (tmp_path / "J1").mkdir()
    (tmp_path / "J1" / timeline.NAME).write_text('{"kind": "run", "job": "J1", "started": 1.7e9, "format": 1}\n')
    assert main_report(["J1", "--runs-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == f"ddp-report report: {tmp_path}/J1/report.html"
    assert (tmp_path / "J1" / "report.html").stat().st_size > 400_000  # Plotly's script inside: it opens offline
    assert main_report(["J2", "--runs-dir", str(tmp_path)]) == 3
    assert "no run J2 in" in capsys.readouterr().err
    assert main_report([]) == 2 and main_report(["a b"]) == 2


def test_a_series_a_bar_and_a_rank_is_drawn_where_it_ran_broken_across_outages_and_attempts():
    """What the page drew misled: a rank that stood 47 s on a lost node read as a steady rate; the
    HF Trainer's checkpoint writer's bar ("Writing model shards ... 1044 it/s") was charted as its
    training; a rank that moved was drawn on its first node. Now: a series a bar, the training one
    charted; a series a rank and node; a break where it had no data or an attempt started; every
    attempt shaded; a chart of one node names it, and one of one point says so."""
    from orchestrator.views.charts import gapped, lines, rates
    from orchestrator.views.rundata import RunData

    assert timeline.bar_name("Epoch 3:  40%|####  | 4/10 [00:02<00:03, 2.00it/s]") == "Epoch"
    assert timeline.bar_name("Writing model shards: 100%|####| 2/2") == "Writing model shards"
    assert gapped([[0, 1], [2, 1], [4, 1], [50, 1], [52, 1], [54, 1]], 2.0, [53], 1) == (
        [0, 2, 4, None, 50, 52, None, 54], [1, 1, 1, None, 1, 1, None, 1])
    train = {"kind": "progress", "rank": 0, "node": "a", "step": 2.0, "bar": "train", "desc": "train",
             "points": [[t, t, 2.0] for t in range(0, 40, 2)]}
    writer = dict(train, bar="Writing model shards", desc="Writing model shards", points=[[41, 1, 1044.0], [42, 2, 1044.0]])
    data = RunData(records=[train, writer, {"kind": "attempt", "attempt": 0, "start": 0.0, "end": 20.0},
                            {"kind": "attempt", "attempt": 1, "start": 20.0, "end": 60.0}])
    fig = rates(data)
    assert [max(y for y in t.y if y is not None) for t in fig.data] == [2.0]  # the writer's 1044 it/s is not charted
    assert fig.layout.title.text.endswith("median 2/s on a") and list(fig.data[0].x).count(None) == 1
    assert [s.opacity for s in fig.layout.shapes] == [0.08]  # attempt 1 shaded
    moved = [{"kind": "lines", "rank": 1, "node": node, "step": 2.0, "points": pts}
             for node, pts in (("a", [[0, 3.0], [2, 3.0]]), ("c", [[30, 3.0]]))]
    fig = lines(RunData(records=moved))
    assert [t.name for t in fig.data] == ["rank 1 (a)", "rank 1 (c)"] and "on " not in fig.layout.title.text
    one = rates(RunData(records=[dict(train, points=[[3, 1, 2.5]])]))
    assert "one point only: 2.5/s" in one.layout.title.text


def test_the_page_carries_plotlys_basic_bundle_at_the_version_the_plotly_package_draws_for():
    import base64
    import gzip
    import re

    from plotly.offline import get_plotlyjs_version

    from orchestrator.views import report

    script = gzip.decompress(base64.b64decode(report.plotly_packed(), validate=True)).decode()
    version = re.search(r"plotly\.js \(basic - minified\) v(\d+)\.(\d+)", script[:300])
    assert version and version.group(1) == get_plotlyjs_version().split(".")[0]  # one major: same attributes
    assert len(report.plotly_packed()) < 600_000  # the full bundle: 2.0 MB packed
