from orchestrator.config import parse_cluster
from orchestrator.job import gpu_shortfalls
from orchestrator.outcome import NodeStatus
from orchestrator.plan import make_plan


def test_more_processes_than_gpus_is_refused_but_cpu_nodes_are_not():
    plan = make_plan(parse_cluster("nodes: [{host: a, gpus: 8}, {host: b, gpus: 8}, {host: c, gpus: 2}]\n"),
                     "t.py", [], "J", "/")
    statuses = [NodeStatus(plan.nodes[0], info={"gpus": 8}), NodeStatus(plan.nodes[1], info={"gpus": 4}),
                NodeStatus(plan.nodes[2], info={"gpus": 0})]
    problems = gpu_shortfalls(statuses)
    assert [(p.node, p.what, p.fix) for p in problems] == [("b", "gpus: 8 but the node has 4 GPU(s)", "set `gpus: 4` for this node")]
