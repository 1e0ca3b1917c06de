import io

from rich.console import Console

from orchestrator.diagnose.outcome import JobSnapshot, NodeRow
from orchestrator.views.dashboard import render


def snapshot(n: int, states: dict[int, str] | None = None) -> JobSnapshot:
    states = states or {}
    rows = tuple(NodeRow(i, f"gpu-{i:02d}", range(2 * i, 2 * i + 2), states.get(i, "running"), 65.0, 100 * i,
                         f"step {i} loss 0.5", "" if states.get(i, "running") == "running" else "1",
                         "rank 3 exited with code 1" if states.get(i) == "failed" else None) for i in range(n))
    return JobSnapshot("J1", "10.0.0.1:29500", 2 * n, 3725.0, "running", rows, 100.0)


def text_of(renderable, height: int = 60) -> str:
    out = io.StringIO()
    Console(file=out, width=140, height=height, color_system=None).print(renderable)
    return out.getvalue()


def test_header_and_one_row_per_node():
    text = text_of(render(snapshot(3), {0: 0.0, 1: 12.4, 2: 3.0}, max_rows=10))
    lines = text.splitlines()
    assert lines[0] == "ddp-up job J1  master 10.0.0.1:29500  world 6  elapsed 1:02:05  running"
    assert lines[1].split() == ["node", "host", "ranks", "state", "up", "lines", "lines/s", "exit", "last", "line"]
    assert lines[3].split() == ["1", "gpu-01", "2-3", "running", "1:05", "100", "12", "step", "1", "loss", "0.5"]
    assert len(lines) == 5


def test_many_nodes_show_the_ones_needing_attention_first():
    text = text_of(render(snapshot(64, {40: "failed", 63: "lost"}), {}, max_rows=6))
    assert "gpu-40" in text and "rank 3 exited with code 1" in text and "gpu-63" in text
    assert "+58 more nodes: 58 running" in text
    assert len(text.splitlines()) == 2 + 6 + 1


def test_a_gpu_column_appears_only_where_the_agents_sample_gpus():
    from dataclasses import replace

    snap = snapshot(2)
    assert "gpu" not in text_of(render(snap, {}, max_rows=10)).splitlines()[1].split()
    snap = replace(snap, nodes=(replace(snap.nodes[0], gpus="87% 61/80G"), snap.nodes[1]))
    lines = text_of(render(snap, {}, max_rows=10)).splitlines()
    assert lines[1].split()[8] == "gpu" and "87% 61/80G" in lines[2]


def wide_snapshot():
    from dataclasses import replace

    bar = "Epoch 3: 45%|████▌     | 450/1000 [01:02<01:15, 7.30it/s, loss=0.31, v_num=0]"
    snap = snapshot(3, {1: "failed"})
    return replace(snap, nodes=tuple(replace(n, label=f"10.213.129.{n.index + 1}", gpus="87% 61/80G", last_line=bar,
                                             progress="45% 7.3it/s eta 1:15") for n in snap.nodes))


def shown_at(width: int) -> list[str]:
    out = io.StringIO()
    Console(file=out, width=width, height=60, color_system=None).print(render(wide_snapshot(), {}, 10, width=width))
    return out.getvalue().splitlines()


def test_in_80_columns_host_ranks_and_state_stay_whole_and_the_last_line_is_cut():
    lines = shown_at(80)
    assert all(len(line) <= 80 for line in lines) and len(lines) == 5  # no row wraps onto a second line
    assert lines[1].split()[:4] == ["node", "host", "ranks", "state"]
    for i, state in enumerate(("running", "failed", "running")):
        assert lines[2 + i].split()[:4] == [str(i), f"10.213.129.{i + 1}", f"{2 * i}-{2 * i + 1}", state], lines
    assert "…" in lines[3] and "rank 3 exit" in lines[3]  # the failure's reason, cut
    assert "lines/s" not in lines[1]  # the least needed columns went first


def test_in_200_columns_every_column_and_the_whole_reason_show():
    lines = shown_at(200)
    assert lines[1].split() == ["node", "host", "ranks", "state", "up", "lines", "lines/s", "exit", "gpu", "progress",
                                "last", "line"]
    assert "rank 3 exited with code 1" in lines[3] and "45% 7.3it/s eta 1:15" in lines[2]


def test_a_view_made_again_under_the_live_table_styles_lines_with_colors_alone():
    """A restart makes the view's inks again while the dashboard's Live runs: once, the capture
    they were made with went through the Live's hook, and every line after it ended with the
    dashboard's old frame (on screen: each rank line read as attempt 0's header)."""
    from rich.live import Live
    from rich.style import Style
    from rich.text import Text

    from orchestrator.views.console import Ink

    console = Console(file=io.StringIO(), force_terminal=True, color_system="standard", width=120)
    before = Ink(console, Style(color="cyan"))
    with Live(Text("ddp-up job J1  running"), console=console, auto_refresh=False, transient=True):
        during = Ink(console, Style(color="cyan"))
    assert (during.open, during.close) == (before.open, before.close) == ("\x1b[36m", "\x1b[0m")


def test_the_live_table_shows_each_nodes_latest_value_of_the_runs_first_metric(tmp_path):
    """Read off the job loop (metricsfile), shown on the table as it comes: the first metric the
    run printed, each node's first rank's latest value; a node with none yet shows nothing."""
    from orchestrator.config.clusterfile import parse_cluster
    from orchestrator.job.events import LogLine
    from orchestrator.plan.launch import make_plan
    from orchestrator.views.metricsfile import MetricsFile

    plan = make_plan(parse_cluster("nodes: [{host: gpu-00, gpus: 2}, {host: gpu-01, gpus: 2}]\n"), "t.py", [], "J1",
                     str(tmp_path))
    metrics = MetricsFile(str(tmp_path), plan)

    class Node:
        label = "gpu-00"

    metrics.lines(Node, [LogLine("out", 1, "step 1 loss 0.9 acc 0.2"), LogLine("out", 0, "step 1 loss 0.75"),
                         LogLine("out", 0, "step 2 loss 0.625")])
    metrics.close()
    assert metrics.shown() == ("loss", {"gpu-00": 0.625})
    text = text_of(render(snapshot(2), {}, max_rows=10, metric=metrics.shown()))
    lines = text.splitlines()
    assert lines[1].split()[7:10] == ["exit", "loss", "last"], text  # before the columns that give way
    assert lines[2].split()[-5:] == ["0.625", "step", "0", "loss", "0.5"], text
    assert lines[3].split()[-5:] == ["0", "step", "1", "loss", "0.5"], text  # none yet on gpu-01: an empty cell
