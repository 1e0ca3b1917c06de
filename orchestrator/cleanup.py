"""Find and stop tagged job processes on nodes: ddp-kill, and the job's fallback for lost nodes.

Runs the same agent as a launch, in ``sweep`` mode: it matches processes by the tags ddp-up put
in their environment (job, node, cluster file), never by name or command line.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .agent import TAG_CLUSTER, TAG_JOB, TAG_NODE
from .config import NodeConfig
from .oneshot import call_agent, on_each
from .transport import Transport


@dataclass
class SweepReport:
    node: NodeConfig
    hostname: str = ""
    found: list[dict] = field(default_factory=list)  # {"pid", "tags", "cmd"}
    killed: list[int] = field(default_factory=list)  # needed SIGKILL after the grace period
    left: list[int] = field(default_factory=list)  # still alive at the end (should be empty)
    error: str | None = None

    @property
    def jobs(self) -> list[str]:
        return sorted({p["tags"].get(TAG_JOB, "?") for p in self.found})


def match_for(job: str | None = None, node: int | None = None, cluster: str | None = None) -> dict:
    """Tag filter: every given value must match; an empty filter matches every ddp-up process."""
    pairs = {TAG_JOB: job, TAG_NODE: None if node is None else str(node), TAG_CLUSTER: cluster}
    return {k: v for k, v in pairs.items() if v is not None}


def sweep_node(node: NodeConfig, match: dict, grace: float, dry_run: bool = False,
               transport: Transport | None = None, timeout: float | None = None) -> SweepReport:
    """Run the agent in sweep mode on one node and collect its report (bounded by ``timeout``)."""
    spec = {"mode": "sweep", "match": match, "grace": grace, "dry_run": dry_run}
    limit = timeout if timeout is not None else grace + node.ssh.connect_timeout + 15
    reply = call_agent(node, spec, limit, until=b"X", transport=transport)
    listed, done = reply.frames.get(b"L", {}), reply.frames.get(b"X", {})
    return SweepReport(node, hostname=listed.get("hostname", ""), found=listed.get("found", []),
                       killed=done.get("killed", []), left=done.get("left", []), error=reply.error)


def sweep_nodes(nodes: list[NodeConfig], match_of, grace: float, dry_run: bool = False) -> list[SweepReport]:
    """Sweep many nodes in parallel; ``match_of(node)`` gives each node's tag filter."""
    return on_each(nodes, lambda n: sweep_node(n, match_of(n), grace, dry_run))
