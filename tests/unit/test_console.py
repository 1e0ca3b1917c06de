import io

from rich.console import Console

from orchestrator.config.clusterfile import parse_cluster
from orchestrator.job.events import LogLine
from orchestrator.diagnose.outcome import Failure, JobResult, NodeStatus
from orchestrator.plan.launch import make_plan
from orchestrator.views.console import ConsoleView


def view():
    cfg = parse_cluster("nodes: [{host: a, gpus: 2}, {host: gpu-long, gpus: 10}]\n")
    plan = make_plan(cfg, "t.py", [], "J", "/")
    out = io.StringIO()
    return plan, ConsoleView(plan, Console(file=out, width=120, color_system=None)), out


def test_lines_are_prefixed_with_aligned_host_and_rank():
    plan, v, out = view()
    v.lines(plan.nodes[0], [LogLine("out", 0, "hello"), LogLine("err", 1, "warn")])
    v.lines(plan.nodes[1], [LogLine("out", 11, "[bold]not markup[/]"), LogLine("out", None, "launcher")])
    assert out.getvalue().splitlines() == [
        "a        r0  | hello",
        "a        r1  ! warn",
        "gpu-long r11 | [bold]not markup[/]",
        "gpu-long     | launcher",
    ]


def test_summary_names_states_and_root_cause():
    plan, v, out = view()
    statuses = [NodeStatus(plan.nodes[0], state="stopped", reason="gpu-long failed"),
                NodeStatus(plan.nodes[1], state="failed", exit_code=1, reason="launcher exited with code 1")]
    fail = Failure(1, "gpu-long", 7, 3, "rank 7 exited with code 3", at=0.0)
    v.finished(JobResult(plan, tuple(s.outcome() for s in statuses), 29500, [fail], elapsed=2.0))
    text = out.getvalue()
    assert "│ 1    │ gpu-long │ 2-11  │ failed  │ 1    │ launcher exited with code 1 │" in text
    assert "root cause: gpu-long (node 1, rank 7): rank 7 exited with code 3" in text
    assert "job J FAILED after 2.0 s (exit status 1)" in text


def test_rank_filter_keeps_launcher_lines():
    plan, _, _ = view()
    out = io.StringIO()
    v = ConsoleView(plan, Console(file=out, width=120, color_system=None), ranks=frozenset({1}))
    v.lines(plan.nodes[0], [LogLine("out", 0, "hidden"), LogLine("out", 1, "shown"), LogLine("err", None, "launcher")])
    assert out.getvalue().splitlines() == ["a        r1  | shown", "a            ! launcher"]


def test_collapse_prints_a_line_every_rank_printed_once():
    plan, _, _ = view()
    out = io.StringIO()
    now = [0.0]
    v = ConsoleView(plan, Console(file=out, width=120, color_system=None), collapse=True, clock=lambda: now[0])
    v.lines(plan.nodes[0], [LogLine("out", r, "banner") for r in (0, 1)] + [LogLine("out", 0, "mine")])
    v.lines(plan.nodes[1], [LogLine("out", r, "banner") for r in range(2, 12)])
    assert out.getvalue().splitlines() == ["*        r0-11 (all) | banner"]
    now[0] = 1.0
    v.tick(None)
    assert out.getvalue().splitlines()[-1] == "a        r0  | mine"


def test_a_two_row_bar_is_two_lines_and_a_replayed_one_is_thinned_by_its_own_time():
    from orchestrator.diagnose.progress import Bar

    plan, v, out = view()
    v.bars(plan.nodes[0], [Bar("err", 0, ("epoch  33%|###  | 1/3", "  0%|     | 0/2"))])
    shown = [line for line in out.getvalue().splitlines() if "%|" in line]
    assert len(shown) == 2 and shown[0].endswith("epoch  33%|###  | 1/3") and shown[1].endswith("0%|     | 0/2"), shown
    for second in (100.0, 104.0, 111.0, 125.0):  # a replay: each at its node's recorded time, all at once here
        v.bars(plan.nodes[0], [Bar("err", 0, (f"step {second:.0f}",))], at=1.7e9 + second)
    assert [line.split()[-1] for line in out.getvalue().splitlines() if "step" in line] == ["100", "111", "125"]


def test_a_line_printed_above_a_live_rich_bar_is_shown_and_logged_once(tmp_path):
    """A DataLoader worker forked under Rich's live bar prints through its own copy of the live
    display: up over the bar, the line, the bar again. Until SETTLE says so the line is one of the
    bar's rows; a snapshot of the bar taken then (plain console, log files) wrote it, and the line it
    then came as was written again (2 of 16 Lightning runs). The bytes are Rich's, as captured."""
    from orchestrator.diagnose.progress import Bar
    from orchestrator.node.watch.screen import SETTLE, Screen
    from orchestrator.views.logfiles import RunLogs

    up = b"\r\x1b[2K\x1b[1A\x1b[2K"  # Rich's step back over its two-row live bar
    now = [0.0]
    screen = Screen(clock=lambda: now[0])
    plan, v, out = view()
    logs = RunLogs(plan, str(tmp_path), wall=lambda: 1.8e9 + now[0])
    lines = []
    for data in (b"epoch 0%\nval 0%" + up + b"epoch 2%\nval 2%", up + b"worker line 0\nepoch 2%\nval 2%"):
        lines += screen.feed(data).decode().splitlines()
    snapshot = [Bar("out", 0, tuple(screen.live()))]
    assert "worker line 0" in snapshot[0].rows  # the moment the line is one of the bar's rows
    for sink in (v, logs):
        sink.bars(plan.nodes[0], snapshot)
    for _ in range(3):  # the rank's own frames go on, the worker's line left above them, done
        now[0] += SETTLE
        lines += (screen.feed(up + b"epoch 5%\nval 5%") + screen.settle()).decode().splitlines()
    assert lines == ["worker line 0"]
    for sink in (v, logs):
        sink.lines(plan.nodes[0], [LogLine("out", 0, text) for text in lines])
    logs.close()
    shown = out.getvalue().splitlines()
    assert [line.split("| ", 1)[1] for line in shown] == ["worker line 0", "epoch 2%", "val 2%"], shown
    assert (tmp_path / "J" / "rank0.log").read_text().splitlines() == ["worker line 0", "epoch 2%", "val 2%"]
    v.lines(plan.nodes[0], [LogLine("out", 0, "worker line 0")])  # printed again later: a line of its own
    assert out.getvalue().splitlines()[-1].endswith("| worker line 0")
