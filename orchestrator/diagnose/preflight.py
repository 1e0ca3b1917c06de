"""Checks across nodes before go, from what every agent reported. Pure: problems as values.

Each agent preflights its own node (workdir, script, torch, the master's port, other processes
on its GPUs); these compare the nodes with each other: the same torch build as the master, no
more processes than GPUs, a real TCP path from every node to the master, the interface that path
takes (which gloo and NCCL are then told to use), and the clocks.
"""

from __future__ import annotations

from ..errors import NodeProblem
from ..node.probes.facts import IFNAME_VARS
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


def interface_env(status: NodeStatus) -> dict[str, str]:
    """GLOO_/NCCL_SOCKET_IFNAME for this node's job: the interface of its route to the master,
    for each the user did not set (in `env:` or the node's own environment)."""
    reach = status.reach
    if reach is None or not reach.ok or not reach.iface:
        return {}
    return {var: reach.iface for var in IFNAME_VARS if var not in (reach.explicit or {})}


def interface_notices(statuses: list[NodeStatus]) -> list[str]:
    """Said once: which interface each node was told to use; and every node whose hostname
    resolves to an address off that interface (what gloo would have picked by itself)."""
    chosen = {s.plan.label: interface_env(s) for s in statuses}
    chosen = {label: env for label, env in chosen.items() if env}
    notices = []
    if chosen:
        names = sorted({iface for env in chosen.values() for iface in env.values()})
        where = f"{names[0]} on {'every node' if len(chosen) == len(statuses) else _nodes(list(chosen))}" \
            if len(names) == 1 else ", ".join(f"{label} {'/'.join(sorted(set(env.values())))}"
                                              for label, env in chosen.items())
        variables = sorted({var for env in chosen.values() for var in env})
        notices.append(f"{' and '.join(variables)} set to the interface that reaches the master: {where}")
    off = [f"{s.plan.label} ({s.reach.hostname} is {s.reach.resolves}, on {s.reach.resolves_iface or 'no interface'})"
           for s in statuses if s.reach is not None and s.reach.iface and s.reach.resolves
           and s.reach.resolves_iface != s.reach.iface]
    if off:
        notices.append(f"hostname off the route to the master on {_nodes(off)}: gloo left to itself would use "
                       "that address, which the other nodes may not reach")
    return notices


def _nodes(labels: list[str], shown: int = 3) -> str:
    return ", ".join(labels[:shown]) + (f" and {len(labels) - shown} more" if len(labels) > shown else "")


def interface_problems(statuses: list[NodeStatus]) -> list[NodeProblem]:
    """An interface set by the user that cannot carry the job to the master."""
    problems = []
    for s in statuses:
        for var, value, why in (s.reach.bad or []) if s.reach else []:
            works = f"`{var}: {s.reach.iface}` (the interface that reaches the master)" if s.reach.iface else \
                "an interface with a route to the master"
            problems.append(NodeProblem(s.plan.label, f"{var}={value}: {why}",
                                        f"unset {var} (ddp-up then names the right one) or set {works}"))
    return problems


def busy_gpu_text(procs: list[dict]) -> str:
    return "; ".join(f"GPU {p['gpu']}: pid {p['pid']} ({p['user']}, {p['cmd'][:60] or '?'}) holds "
                     f"{'?' if p.get('mib') is None else format(p['mib'], ',')} MiB" for p in procs)


def busy_gpus(statuses: list[NodeStatus], allowed: bool) -> tuple[list[NodeProblem], list[str]]:
    """Other processes holding memory on the GPUs the job will use: problems, or with
    --allow-busy-gpus notices."""
    problems, notices = [], []
    for s in statuses:
        procs = s.info.get("busy_gpus") or []
        if not procs:
            continue
        what = f"{len(procs)} other process(es) hold memory on the job's GPUs: {busy_gpu_text(procs)}"
        if allowed:
            notices.append(f"{s.plan.label}: {what} (--allow-busy-gpus)")
        else:
            problems.append(NodeProblem(s.plan.label, what,
                                        "stop them (a leftover run: ddp-kill CLUSTER.yaml), choose other GPUs with "
                                        "CUDA_VISIBLE_DEVICES in `env:`, or pass --allow-busy-gpus to share them"))
    return problems, notices


def skew_notices(statuses: list[NodeStatus]) -> list[str]:
    return [f"{s.plan.label}: clock differs from this machine's by {s.clock_skew:+.1f} s"
            for s in statuses if s.clock_skew is not None and abs(s.clock_skew) > SKEW_WARNING]


def cross_node_problems(statuses: list[NodeStatus], master_index: int, target: str,
                        busy: list[NodeProblem] = ()) -> list[NodeProblem]:
    """Everything above that stops a launch, in a stable order (``busy``: busy_gpus' problems)."""
    return (torch_mismatches(statuses, master_index) + gpu_shortfalls(statuses) + list(busy)
            + unreachable_master(statuses, target) + interface_problems(statuses))


def accelerate_notices(statuses: list[NodeStatus], script: str, launcher: str, accelerate: bool) -> list[str]:
    """An Accelerate script (``accelerate``: phases.uses_accelerate) under torchrun on nodes
    without GPUs trains alone in every rank (DistributedType.NO, exit 0) unless ACCELERATE_USE_CPU
    is set: said before it starts."""
    cpu_only = statuses and all(not s.info.get("gpus") for s in statuses)
    unset = all("ACCELERATE_USE_CPU" not in s.plan.env for s in statuses)
    if launcher == "accelerate" or not cpu_only or not unset or not accelerate:
        return []
    return [f"{script} uses Accelerate and these nodes have no GPU: without ACCELERATE_USE_CPU=1 in `env:` each "
            "rank trains alone (Accelerate's DistributedType.NO) and still exits 0; set it, or use "
            "`launcher: accelerate`, which sets it on nodes without GPUs"]
