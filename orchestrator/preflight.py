"""Checks across nodes before go, from what every agent reported. Pure: problems as values.

Each agent preflights its own node (workdir, script, torch, the master's port); these compare
the nodes with each other: the same torch build as the master, no more processes than GPUs, a
real TCP path from every node to the master, and the clocks.
"""

from __future__ import annotations

from .errors import NodeProblem
from .outcome import NodeStatus

TORCH_FIELDS = ("torch", "cuda", "nccl")
PROBE_TIMEOUT = 3.0  # for each node's TCP connect to the master
SKEW_WARNING = 5.0  # seconds of clock difference worth a warning (logs and timeouts get confusing)


def torch_versions(info: dict, fields=TORCH_FIELDS) -> str:
    """``2.4.0+cu121 (CUDA 12.1, NCCL 2.20.5)``, naming only ``fields`` that are known."""
    extra = [f"{name} {info[key]}" for key, name in (("cuda", "CUDA"), ("nccl", "NCCL"))
             if key in fields and info.get(key)]
    return f"{info.get('torch') or '-'}" + (f" ({', '.join(extra)})" if extra else "")


def torch_build(info: dict, fields=TORCH_FIELDS) -> str:
    return f"torch {torch_versions(info, fields)}"


def torch_mismatches(statuses: list[NodeStatus], master_index: int) -> list[NodeProblem]:
    """torch, and the CUDA and NCCL it uses, must agree with the master's; a field a node could
    not read (NCCL from conda, say) is not compared."""
    master = statuses[master_index]
    problems = []
    for s in statuses:
        differ = [key for key in TORCH_FIELDS if _differs(key, s.info, master.info)]
        if differ:
            problems.append(NodeProblem(s.plan.label, f"{torch_build(s.info, differ)} here, "
                                        f"{torch_build(master.info, differ)} on the master ({master.plan.label})",
                                        "install the same torch build (CUDA, NCCL) on every node"))
    return problems


def _differs(key: str, mine: dict, theirs: dict) -> bool:
    a, b = mine.get(key), theirs.get(key)
    return a != b and (key == "torch" or bool(a and b))


def gpu_shortfalls(statuses: list[NodeStatus]) -> list[NodeProblem]:
    """Nodes asked to run more processes than they have GPUs. A node with no GPU detected is
    left alone: CPU jobs (gloo) are legitimate, and the driver may not expose /proc there."""
    problems = []
    for s in statuses:
        have = s.info.get("gpus") or 0
        if 0 < have < s.plan.nproc:
            problems.append(NodeProblem(s.plan.label, f"gpus: {s.plan.nproc} but the node has {have} GPU(s)",
                                        f"set `gpus: {have}` for this node"))
    return problems


def unreachable_master(statuses: list[NodeStatus], target: str) -> list[NodeProblem]:
    """Nodes whose probe of the master's addr:port failed or never answered."""
    problems = []
    for s in statuses:
        if s.reach is None or not s.reach.ok:
            why = s.reach.error if s.reach else "no answer to the probe"
            problems.append(NodeProblem(s.plan.label, f"cannot reach the master at {target} ({why})",
                                        "check master.addr is the address nodes use to reach the master, "
                                        "and that no firewall blocks the port"))
    return problems


def skew_notices(statuses: list[NodeStatus]) -> list[str]:
    return [f"{s.plan.label}: clock differs from this machine's by {s.clock_skew:+.1f} s"
            for s in statuses if s.clock_skew is not None and abs(s.clock_skew) > SKEW_WARNING]


def cross_node_problems(statuses: list[NodeStatus], master_index: int, target: str) -> list[NodeProblem]:
    """Everything above that stops a launch, in a stable order."""
    return (torch_mismatches(statuses, master_index) + gpu_shortfalls(statuses)
            + unreachable_master(statuses, target))
