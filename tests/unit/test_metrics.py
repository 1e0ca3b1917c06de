"""Metrics from what ranks print (diagnose/metrics.py), kept in metrics.csv (views/metricsfile.py)
and charted first on the page (views/metriccharts.py): the forms trainers print, the cluster file's
own patterns, and hostile text, bounded and escaped."""

from __future__ import annotations

import csv
import math
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.config.clusterfile import parse_cluster
from orchestrator.config.metricpatterns import checked_patterns
from orchestrator.diagnose.metrics import LINE_MOST, MetricReader, Value, patterns_of
from orchestrator.errors import ConfigError
from orchestrator.job.events import LogLine
from orchestrator.plan.launch import make_plan
from orchestrator.views import metricsfile
from orchestrator.views.metriccharts import Row, metrics_section, read_rows, smoothed

READ = MetricReader().read

FORMS = {
    "the README's demo": ("step 3 loss 6.4149", [Value("loss", 6.4149, 3.0)]),
    "step with more pairs": ("step 12 | loss 0.5 | lr 1e-4", [Value("loss", 0.5, 12.0), Value("lr", 1e-4, 12.0)]),
    "HF Trainer's dict": ("{'loss': 0.69, 'grad_norm': 1.5, 'learning_rate': 5e-05, 'epoch': 0.25}",
                          [Value("loss", 0.69, 0.25), Value("grad_norm", 1.5, 0.25), Value("learning_rate", 5e-05, 0.25)]),
    "JSON with its step": ('{"loss": 1.5, "global_step": 10, "epoch": 2}', [Value("loss", 1.5, 10.0)]),
    "Lightning's bar": ("Epoch 1:  50%|#####     | 4/8 [00:01<00:01,  3.90it/s, v_num=0, train_loss=0.123]",
                        [Value("train_loss", 0.123, 12.0)]),
    "tqdm's postfix": ("100%|##########| 20/20 [00:02<00:00, 9.8it/s, loss=0.31, acc=0.9]",
                       [Value("loss", 0.31, 20.0), Value("acc", 0.9, 20.0)]),
    "HF Trainer's recent logs, quoted": ("{'loss': '1.385', 'grad_norm': '0.283', 'epoch': '0.25'}",
                                         [Value("loss", 1.385, 0.25), Value("grad_norm", 0.283, 0.25)]),
    "Lightning's rich bar": ("Epoch 2/2  ━━━━━━━━━━ 8/8 0:00:00 • 0:00:00 101.31it/s v_num: 0 train_loss: 0.090",
                             [Value("train_loss", 0.09, 24.0)]),
    "space-separated pairs": ("loss: 0.5 acc: 0.9", [Value("loss", 0.5, None), Value("acc", 0.9, None)]),
    "Keras": ("100/100 - 1s - loss: 0.6931 - accuracy: 0.5000", [Value("loss", 0.6931, None), Value("accuracy", 0.5, None)]),
}
NOT_METRICS = ["[W1206 18:40:17.270628460 socket.cpp:207] [c10d] The hostname cannot be retrieved. err=-3",
               "TPU available: False, using: 0 TPU cores", "`Trainer.fit` stopped: `max_epochs=3` reached.",
               "2026-12-06 18:30:01 INFO rank 3 world_size 4", "resumed after step 4 at world size 2",
               "rank 0/2 on vm: all_reduce ok (3)", "time: 12:30:01", "elapsed 0:01:02", "v_num=0 rank=3 world_size=8",
               "lr=nan loss=1e400 acc=inf", "<b>x</b>=3 <script>=4", "http://host:8080/x", "Epoch 1/10"]


@pytest.mark.parametrize("form", sorted(FORMS))
def test_the_forms_trainers_print_are_read_with_their_step(form):
    text, values = FORMS[form]
    assert READ(text) == values


@pytest.mark.parametrize("text", NOT_METRICS)
def test_counters_dates_ranks_and_numbers_that_are_not_finite_are_no_metrics(text):
    assert READ(text) == []


def test_the_cluster_files_own_patterns_read_besides_or_instead_of_the_defaults():
    config = parse_cluster("metrics: ['(?P<name>val_\\w{1,20}) is (?P<value>[0-9.]{1,20}) at (?P<step>\\d{1,9})', "
                           "{name: bleu, pattern: 'BLEU = (?P<value>[0-9.]{1,10})'}]\nnodes: [{host: a, gpus: 1}]\n")
    reader = MetricReader(patterns_of(config.metrics))
    assert reader.read("val_acc is 0.91 at 300") == [Value("val_acc", 0.91, 300.0)]
    assert reader.read("BLEU = 27.4 step 9") == [Value("bleu", 27.4, 9.0)]
    assert reader.read("step 3 loss 2.5") == [Value("loss", 2.5, 3.0)]  # the defaults too
    only = MetricReader(patterns_of(config.metrics), defaults=False)
    assert only.read("step 3 loss 2.5") == []
    assert parse_cluster("metrics: false\nnodes: [{host: a, gpus: 1}]\n").metrics is None


@pytest.mark.parametrize("pattern, why", [
    ("(a+)+(?P<value>x)", "repeats a group that holds a repeat"),
    ("((ab|a)*)(?P<value>\\d)", "repeats a group of alternatives"),
    ("(\\w)\\1(?P<value>\\d)", "backreference or a lookaround"),
    ("(?<=x)(?P<value>\\d)", "backreference or a lookaround"),
    ("(?P<name>\\w+)=(?P<value>[\\d.]+)", "more than one unbounded repeat"),
    ("(?P<value>\\d)\\w{0,3000}", "repeats up to 3000 times"),
    ("(?P<name>x", "not a regular expression"),
    ("loss (?P<number>\\d)", "no (?P<value>...) group"),
])
def test_a_pattern_that_could_take_more_than_linear_time_is_refused_with_the_key_and_line(tmp_path, pattern, why):
    path = tmp_path / "c.yaml"
    path.write_text("nodes: [{host: a, gpus: 1}]\nmetrics:\n  - '" + pattern.replace("'", "''") + "'\n")
    with pytest.raises(ConfigError) as e:
        parse_cluster(path.read_text(), path=str(path))
    assert why in str(e.value) and "metrics[0]" in str(e.value) and ":3" in str(e.value), str(e.value)


def test_a_line_built_to_backtrack_and_a_1_mb_line_are_read_in_bounded_time():
    reader = MetricReader(patterns_of(checked_patterns(["(?P<name>a{1,60})=(?P<value>[0-9.]+)"])[0]))
    hostile = ["a" * 1_000_000, "a=" * 500_000, "1" * 1_000_000, "{'" + "x" * 1_000_000, "step 1" + " a 1" * 300_000]
    started = time.process_time()
    for line in hostile:
        assert len(reader.read(line)) <= 64
    assert time.process_time() - started < 2.0  # each reads its first LINE_MOST characters only


@settings(max_examples=300, deadline=None, database=None)
@given(st.text(max_size=3 * LINE_MOST))
def test_any_text_gives_plain_names_and_finite_values_never_an_error(text):
    for value in READ(text):
        assert value.name and len(value.name) <= 64 and all(c.isalnum() or c in "_.-/ " for c in value.name)
        assert math.isfinite(value.value) and (value.step is None or math.isfinite(value.step))


def plan(tmp_path, **top):
    head = "".join(f"{k}: {v}\n" for k, v in top.items())
    return make_plan(parse_cluster(head + "nodes: [{host: a, gpus: 2}, {host: b, gpus: 2}]\n"), "t.py", [], "J1",
                     str(tmp_path))


class Node:
    def __init__(self, label):
        self.label = label


def rows_of(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_metrics_csv_has_a_row_a_value_written_as_the_run_goes(tmp_path):
    view = metricsfile.MetricsFile(str(tmp_path), plan(tmp_path))
    view.lines(Node("a"), [LogLine("out", 0, "step 0 loss 2.5"), LogLine("out", 1, "step 0 loss 2.7"),
                           LogLine("out", None, "step 9 loss 9"), LogLine("out", 0, "step 1 lo", more=True)])
    deadline = time.monotonic() + 10
    while not (tmp_path / "metrics.csv").exists() or len(rows_of(tmp_path / "metrics.csv")) < 2:
        assert time.monotonic() < deadline, "not written while the run goes"
        view.lines(Node("a"), [])  # (nothing new: the reader flushes within FLUSH_EVERY)
        time.sleep(0.05)
    view.attempt(type("P", (), {"attempt": 1})())
    view.bars(Node("b"), [type("B", (), {"rank": 2, "rows": ("Epoch 0:  40%| 2/5 [00:01<00:01, v_num=0, loss=0.5]",)})()])
    view.bars(Node("b"), [type("B", (), {"rank": 2, "rows": ("Epoch 0:  40%| 2/5 [00:01<00:01, v_num=0, loss=0.5]",)})()])
    view.close()
    rows = rows_of(tmp_path / "metrics.csv")
    assert list(rows[0]) == list(metricsfile.COLUMNS)
    assert [(r["attempt"], r["rank"], r["node"], r["step"], r["name"], r["value"]) for r in rows] == [
        ("0", "0", "a", "0", "loss", "2.5"), ("0", "1", "a", "0", "loss", "2.7"),
        ("1", "2", "b", "2", "loss", "0.5")]  # the launcher's line is no rank's; a redrawn bar is one row
    assert view.said() is None


def test_the_bounds_of_names_and_series_are_kept_and_what_they_left_out_is_said(tmp_path, monkeypatch):
    monkeypatch.setattr(metricsfile, "SERIES_MOST", 10)
    view = metricsfile.MetricsFile(str(tmp_path), plan(tmp_path))
    view.lines(Node("a"), [LogLine("out", 0, f"m{i}=1") for i in range(1000)])  # a thousand distinct names
    view.lines(Node("a"), [LogLine("out", 0, f"step {i} loss {i}") for i in range(40)])
    view.close()
    rows = rows_of(tmp_path / "metrics.csv")
    assert len({r["name"] for r in rows}) == metricsfile.NAMES_MOST
    assert [float(r["step"]) for r in rows if r["name"] == "loss"] == []  # past NAMES_MOST already
    said = view.said()
    assert f"940 values of names past the first {metricsfile.NAMES_MOST}" in said  # loss came after the 100th


def test_a_long_series_is_thinned_not_cut(tmp_path, monkeypatch):
    monkeypatch.setattr(metricsfile, "SERIES_MOST", 10)
    view = metricsfile.MetricsFile(str(tmp_path), plan(tmp_path))
    view.lines(Node("a"), [LogLine("out", 0, f"step {i} loss {i}") for i in range(40)])
    view.close()
    steps = [int(float(r["step"])) for r in rows_of(tmp_path / "metrics.csv")]
    assert steps[:10] == list(range(10)) and steps[-1] == 39 and len(steps) < 40  # the end kept, the rest sparser
    assert "values thinned out of long series" in view.said()


def test_a_secret_in_a_metrics_name_is_masked(tmp_path, monkeypatch):
    p = plan(tmp_path, env="{MY_TOKEN: hunter2}", secrets="[MY_TOKEN]")
    view = metricsfile.MetricsFile(str(tmp_path), p)
    view.lines(Node("a"), [LogLine("out", 0, "hunter2_loss=3")])
    view.close()
    assert "hunter2" not in (tmp_path / "metrics.csv").read_text()


def row(attempt, rank, step, value, name="loss", t=0.0):
    return Row(t, attempt, rank, "a", step, name, value)


def test_the_page_charts_each_metric_a_rank_a_line_breaking_between_attempts_marked_with_their_world():
    rows = [row(0, r, s, 10 - s) for r in (0, 1, 2) for s in range(3)] + \
           [row(1, r, s, 8 - s) for r in (0, 1) for s in range(3, 6)]
    import html

    figures, table = metrics_section(rows, {0: 3, 1: 2}, 0.0, html.escape)
    assert [name for name, _ in figures] == ["metric-0"]
    fig = figures[0][1]
    rank0 = next(t for t in fig.data if t.name == "rank 0")
    assert list(rank0.x) == [0, 1, 2, None, 3, 4, 5] and list(rank0.y)[3] is None  # the line breaks at the attempt
    assert [a.text for a in fig.layout.annotations] == ["attempt 1: world 2"]
    assert [b.label for b in fig.layout.updatemenus[0].buttons] == ["smoothing 0", "smoothing 0.6", "smoothing 0.9"]
    assert "<td>loss</td><td>3</td><td>step 5</td><td>3</td><td>step 5 (rank 0)</td>" in table


def test_past_a_handful_of_ranks_the_page_draws_rank_0_the_median_and_the_spread():
    import html

    rows = [row(0, r, s, float(r + s)) for r in range(16) for s in range(4)]
    fig = metrics_section(rows, {}, 0.0, html.escape)[0][0][1]
    names = [t.name for t in fig.data if t.visible is not False]
    assert "rank 0" in names and "median" in names and "spread of 16 ranks" in names and "rank 5" not in names


def test_markup_in_a_metrics_name_is_escaped_on_the_page(tmp_path):
    (tmp_path / "metrics.csv").write_text(",".join(metricsfile.COLUMNS) + "\n1.0,0,0,a,1,<img src=x>,1\n"
                                          "1.0,0,0,a,1,ok,nan\n1.0,0,0,a,1,ok,1e400\n1.0,x,0,a,1,ok,1\n1.0,0,0,a,,ok,2\n")
    missing = []
    rows = read_rows(str(tmp_path), missing)
    assert [(r.name, r.value) for r in rows] == [("ok", 2.0)] and "4 damaged" in missing[0]


def test_smoothing_is_tensorboards_moving_average_and_starts_over_after_a_break():
    assert smoothed([1.0, 1.0, None, 5.0], 0.9) == pytest.approx([1.0, 1.0, None, 5.0])
    assert smoothed([0.0, 10.0], 0.5)[1] == pytest.approx(10.0 * 0.5 / 0.75)


def test_ddp_report_of_several_jobs_puts_their_curves_on_one_chart_and_names_what_differed(tmp_path, capsys):
    import json

    from orchestrator.commands.report import main_report

    for job, restarts, lr, values in (("20261206-010101-aaaaaa", 0, "0.1", (3.0, 2.0, 1.0)),
                                      ("20261206-020202-bbbbbb", 2, "0.01", (3.0, 2.5, 2.2))):
        where = tmp_path / job
        where.mkdir()
        (where / "cluster.yaml").write_text(f"restarts: {restarts}\nnodes: [{{host: a, gpus: 2}}]\nenv: {{X: <b>1</b>}}\n")
        (where / "run.json").write_text(json.dumps({"command": ["ddp-up", "c.yaml", "train.py", "--lr", lr],
                                                    "git": {"commit": "abc"}, "versions": {"torch": "2.13.0"}}))
        (where / "summary.json").write_text(json.dumps({"job_id": job, "exit_code": 0, "world_size": 2}))
        (where / "metrics.csv").write_text(",".join(metricsfile.COLUMNS) + "\n" + "".join(
            f"{1e9 + s},0,{rank},a,{s},loss,{v + 2 * rank}\n" for s, v in enumerate(values)
            for rank in range(1 + restarts // 2)))  # the second run: two ranks, 2.0 apart
    (tmp_path / "20261206-030303-cccccc").mkdir()  # a run that printed none
    jobs = sorted(p.name for p in tmp_path.iterdir())
    assert main_report([*jobs, "--runs-dir", str(tmp_path)]) == 0
    said = capsys.readouterr().out
    page_path = said.rsplit(": ", 1)[1].strip()
    assert said.startswith("ddp-report compared 3 runs: ") and page_path.endswith(".html"), said
    page = open(page_path).read()
    assert '"name":"20261206-010101-aaaaaa (rank 0)"' in page and '"y":[3.0,2.0,1.0]' in page
    assert '"name":"20261206-020202-bbbbbb (median of 2 ranks)"' in page and '"y":[4.0,3.5,3.2]' in page
    assert '"y":[5.0,4.5,4.2]' in page and '"fill":"tonexty"' in page  # the spread: its most, down to its least
    assert "<th>cluster file: restarts</th><td>0</td><td>2</td><td>(not set)</td>" in page
    assert "--lr 0.01" in page and "<b>1</b>" not in page and "&lt;b&gt;1&lt;/b&gt;" not in page.split("What differed")[0]
    assert "20261206-030303-cccccc: printed no metrics" in page and "<td>None</td>" not in page
    assert main_report(["20261206-010101-aaaaaa", "20261206-999999-zzzzzz", "--runs-dir", str(tmp_path)]) == 3


def test_a_long_runs_page_is_made_while_it_goes_and_says_it_is_partial(tmp_path, monkeypatch):
    from orchestrator.run import runloop
    from orchestrator.views.report import REPORT

    plan_ = plan(tmp_path)
    kept = timeline_of(tmp_path, plan_)
    kept.write()  # as its writer does every 30 s
    monkeypatch.setattr(runloop.PagesMeanwhile, "PAGE_EVERY", 0.05)
    with runloop.PagesMeanwhile(str(tmp_path)):
        deadline = time.monotonic() + 20
        while not (tmp_path / REPORT).exists():
            assert time.monotonic() < deadline, "no page while the run went on"
            time.sleep(0.05)
    assert "(partial: made while the run went on)" in (tmp_path / REPORT).read_text()


def timeline_of(tmp_path, p):
    from orchestrator.views.timeline import Timeline

    return Timeline(str(tmp_path), p)
