"""ddp-check --collective's reading of the probe's report: which node is slow, and the tables."""

from __future__ import annotations

import json

from rich.console import Console

from orchestrator.diagnose import collective
from orchestrator.config.clusterfile import parse_cluster

MB4 = 4 << 20


def report(world: int, slow_out: int | None = None, seconds: float = 0.01) -> dict:
    """Links of both rings as the probe reports them: [src, dst, bytes, seconds, ping]; the
    links out of ``slow_out`` take 100 times longer (its egress shaped, as with tc tbf)."""
    links = []
    for stride in (1, 2) if world > 2 else (1,):
        for dst in range(world):
            src = (dst - stride) % world
            links.append([src, dst, MB4, seconds * (100 if src == slow_out else 1), 0.0003])
    return {"backend": "gloo", "world": world, "all_reduce": [[65536, 0.004], [1 << 20, 0.2], [16 << 20, None]],
            "links": links, "hosts": [f"n{i}" for i in range(world)], "seconds": 3.0}


def test_the_node_with_a_slow_egress_is_named_and_its_partners_are_not():
    for world in (3, 4, 16):
        links = collective.node_links(report(world, slow_out=world - 1))
        assert collective.slow_nodes(links) == [world - 1], world
    assert collective.slow_nodes(collective.node_links(report(16))) == []


def test_two_nodes_share_one_link_and_neither_is_named():
    links = collective.node_links(report(2, slow_out=1))
    assert collective.slow_nodes(links) == [] and links[1].out_bw < links[0].out_bw


def test_only_rank_zeros_report_line_is_read():
    line = collective.REPORT + json.dumps(report(3))
    assert collective.read_report(line)["world"] == 3
    assert collective.read_report("DDP_UP_COLLECTIVE {not json") is None
    assert collective.read_report("DDP_UP_COLLECTIVE [1, 2]") is None
    assert collective.read_report("step 3 loss 0.1") is None


def test_the_tables_show_skipped_sizes_and_the_slow_node():
    console = Console(width=120, record=True, color_system=None)
    console.print(collective.render(report(4, slow_out=2), ["a", "b", "gpu-slow", "d"]))
    text = console.export_text()
    assert "all_reduce across 4 nodes (gloo)" in text
    assert "skipped: the smaller size says too slow" in text
    row = next(line for line in text.splitlines() if "gpu-slow" in line)
    assert "4.2 MB/s" in row and "slow: 0.01× the median" in row
    assert "slow" not in next(line for line in text.splitlines() if "│ a " in line)


def test_the_probe_runs_one_process_per_node_under_torchrun_from_the_shipped_module():
    config = parse_cluster("launcher: none\nnodes: [{host: a, gpus: 8}, {host: b, gpus: 4}]\n")
    plan = collective.probe_plan(config, "J", "/tmp")
    assert [n.nproc for n in plan.nodes] == [1, 1] and plan.world_size == 2
    argv = plan.launcher_argv(plan.nodes[1], 29500)
    assert argv[2:4] == ["-m", "torch.distributed.run"] and argv[-2:] == ["-m", collective.MODULE]
    spec = plan.agent_spec(plan.nodes[0])
    assert "import torch.distributed as dist" in spec.hooks[f"{collective.MODULE}.py"] and spec.script == ""


def test_the_probe_forks_warm_with_torch_alone_unless_the_cluster_file_says_warm_false():
    config = parse_cluster("preload: [lightning]\nnodes: [{host: a, gpus: 2}, {host: b, gpus: 2}]\n")
    plan = collective.probe_plan(config, "J", "/tmp")
    argv = plan.launcher_argv(plan.nodes[0], 29500)
    # torchrun's worker is the stand-in, which asks the node's interpreter for `-m MODULE`
    assert argv[-6:-3] == ["--no-python", plan.nodes[0].config.python, "-S"] and argv[-3].startswith("-c"), argv
    assert argv[-2:] == ["-m", collective.MODULE]
    spec = plan.agent_spec(plan.nodes[0])
    assert spec.warm and not spec.preload  # the job's preload is the job's: the probe needs torch only
    cold = collective.probe_plan(parse_cluster("warm: false\nnodes: [{host: a, gpus: 1}, {host: b, gpus: 1}]\n"),
                                 "J", "/tmp")
    assert not cold.agent_spec(cold.nodes[0]).warm and cold.launcher_argv(cold.nodes[0], 1)[-2:] == ["-m", collective.MODULE]
    assert "--no-python" not in cold.launcher_argv(cold.nodes[0], 1)


def test_the_summary_says_on_how_many_nodes_the_probe_was_forked_warm_and_only_a_count_it_can_trust():
    assert collective.start_text({"world": 4, "warm": 4}) == \
        "start, import torch; the probe forked from a warm interpreter on 4 of 4 nodes"
    assert collective.start_text({"world": 4, "warm": 3}).endswith("on 3 of 4 nodes")
    for report in ({"world": 4}, {"world": 4, "warm": 0}, {"world": 4, "warm": 5}, {"world": 4, "warm": True},
                   {"world": 4, "warm": "4\x1b[2J"}, {"world": "4", "warm": 4}, {}):
        assert collective.start_text(report) == "start, import torch", report  # cold, or a count not to be shown
