"""``gpus: auto``: ask each such node how many GPUs the job would see, before planning.

One short agent call per auto node, in parallel, so planning stays pure: the plan is made from a
cluster whose counts are all known, and no view or rank ever changes after it is drawn.
"""

from __future__ import annotations

from ..config.cluster import ClusterConfig, NodeConfig
from ..errors import NodeProblem, SetupError
from ..node.protocol import wire
from .oneshot import Calls, Reply, call_agent
from .transports import transport_for
from .parallel import on_each

DETECT_MARGIN = 15.0  # seconds for the agent to start and answer, on top of the connect timeout


def resolve_auto_gpus(config: ClusterConfig) -> ClusterConfig:
    """The cluster with every `gpus: auto` replaced by the node's count; SetupError naming each
    node that cannot be reached or shows no GPU."""
    nodes = config.auto_gpus
    if not nodes:
        return config
    # With the node's `setup:` first: what it exports (CUDA_VISIBLE_DEVICES, a venv's python) is
    # the job's environment, and the count must be the one the job will see.
    replies = on_each(nodes, lambda n: call_agent(n, wire.DetectSpec(env=dict(n.env)),
                                                  n.ssh.connect_timeout + DETECT_MARGIN, until=wire.Detected,
                                                  setup=True), name="detect")
    problems = [p for p in map(_problem, replies) if p is not None]
    if problems:
        raise SetupError(problems)
    return config.resolve_gpus({r.node.rank: r.frames[wire.Detected].gpus for r in replies})


def _problem(reply: Reply) -> NodeProblem | None:
    if reply.problem is not None:
        return reply.problem
    if reply.frames[wire.Detected].gpus < 1:
        return NodeProblem(reply.node.label,
                           "gpus: auto, but the job would see no GPU here (no NVIDIA GPU in "
                           "/proc/driver/nvidia/gpus, or CUDA_VISIBLE_DEVICES hides them all)",
                           "set `gpus:` to the number of processes for this node")
    return None


class Answering:
    """Which nodes answer (``__call__``: the labels of those reached, their agent started after
    `setup:` and its answer read, each within its connect timeout and DETECT_MARGIN), from any
    thread; ``cut`` ends the asks under way (the run ends: their ssh processes with it). A node
    lost earlier is asked so before it rejoins (its preflight then checks the rest)."""

    def __init__(self) -> None:
        self.calls = Calls()
        self.unfit: dict[str, NodeProblem] = {}  # nodes that answer again but cannot run (no python): why

    def __call__(self, nodes: list[NodeConfig]) -> set[str]:
        # a connection of its own: the run's shared one to a node that was lost may be hung on a dead link
        replies = on_each(nodes, lambda n: call_agent(n, wire.DetectSpec(env=dict(n.env)),
                                                      n.ssh.connect_timeout + DETECT_MARGIN, until=wire.Detected,
                                                      transport=transport_for(n, shared=False), setup=True,
                                                      calls=self.calls),
                          inbox=None, name="rejoin")
        for r in replies:
            if r.problem is not None and r.reached:
                self.unfit[r.node.label] = r.problem
            else:
                self.unfit.pop(r.node.label, None)
        return {r.node.label for r in replies if r.problem is None}

    def cut(self) -> None:
        self.calls.cut()
