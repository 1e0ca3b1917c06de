"""Find and stop tagged job processes on nodes: ddp-kill, and the job's fallback for lost nodes.

Runs the same agent as a launch, in sweep mode: it matches processes by the tags ddp-up put in
their environment (job, node, cluster file), never by name or command line.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

from ..config.cluster import NodeConfig
from ..node.protocol import wire
from ..node.local.procs import TAG_CLUSTER, TAG_JOB, TAG_NODE, TAG_RUN
from .oneshot import call_agent
from .parallel import on_each
from .transport import Transport

SWEEP_MARGIN = 15.0  # seconds for the sweep agent to start and report, on top of connect + grace


@dataclass
class SweepReport:
    node: NodeConfig
    found: list[dict] = field(default_factory=list)  # {"pid", "tags", "cmd"}
    killed: list[int] = field(default_factory=list)  # needed SIGKILL after the grace period
    left: list[int] = field(default_factory=list)  # still alive at the end (should be empty)
    error: str | None = None
    removed: list[str] = field(default_factory=list)  # state it removed (--purge): "JOB nodeN"
    signalled: list[int] = field(default_factory=list)  # --signal: the ranks it reached
    containers: list[str] = field(default_factory=list)  # the job's containers it removed (by label)

    @property
    def jobs(self) -> list[str]:
        return sorted({p["tags"].get(TAG_JOB, "?") for p in self.found})


def match_for(job: str | None = None, node: int | None = None, cluster: str | None = None,
              run: str | None = None) -> dict:
    """Tag filter: every given value must match; an empty filter matches every ddp-up process."""
    pairs = {TAG_JOB: job, TAG_NODE: None if node is None else str(node), TAG_CLUSTER: cluster, TAG_RUN: run}
    return {k: v for k, v in pairs.items() if v is not None}


def sweep_limit(node: NodeConfig, grace: float) -> float:
    return 2 * grace + node.ssh.connect_timeout + SWEEP_MARGIN  # detached agents get a grace of their own first


def sweep_node(node: NodeConfig, match: dict, grace: float, dry_run: bool = False,
               transport: Transport | None = None, purge: bool = False, signal: str | None = None) -> SweepReport:
    """Run the agent in sweep mode on one node and collect its report (bounded by sweep_limit);
    with ``signal``, that signal to every rank found instead, stopping nothing."""
    runtimes = [node.container.runtime] if node.container is not None else None  # the node picks the daemons'
    spec = wire.SweepSpec(match=match, grace=grace, dry_run=dry_run, purge=purge, signal=signal, runtimes=runtimes)
    reply = call_agent(node, spec, sweep_limit(node, grace), until=wire.Swept, transport=transport)
    listed, swept = reply.frames.get(wire.Listed), reply.frames.get(wire.Swept)
    return SweepReport(node, found=listed.found if listed else [], killed=swept.killed if swept else [],
                       left=swept.left if swept else [], error=reply.error, removed=(swept.removed or []) if swept else [],
                       signalled=(swept.signalled or []) if swept else [],
                       containers=(swept.containers or []) if swept else [])


def sweep_nodes(nodes: list[NodeConfig], match_of, grace: float, dry_run: bool = False,
                purge: bool = False, signal: str | None = None) -> list[SweepReport]:
    """Sweep many nodes in parallel; ``match_of(node)`` gives each node's tag filter."""
    return on_each(nodes, lambda n: sweep_node(n, match_of(n), grace, dry_run, purge=purge, signal=signal),
                   name="sweep")


class LostNodeSweeper:
    """A lost node may still run job processes: sweep them over a fresh connection, at once and
    in parallel with stopping the other nodes; ``finish`` collects the reports (bounded)."""

    def __init__(self, job_id: str, run_token: str, grace: float,
                 transport_factory: Callable[[NodeConfig], Transport]):
        self.job_id = job_id
        self.run_token = run_token
        self.grace = grace
        self.transport_factory = transport_factory
        self._threads: list[tuple[NodeConfig, threading.Thread]] = []
        self._reports: list[SweepReport] = []

    def start(self, node: NodeConfig) -> None:
        def sweep() -> None:
            match = match_for(job=self.job_id, node=node.rank, run=self.run_token or None)
            self._reports.append(sweep_node(node, match, self.grace, transport=self.transport_factory(node)))

        thread = threading.Thread(target=sweep, name=f"sweep-{node.label}", daemon=True)
        thread.start()
        self._threads.append((node, thread))

    def finish(self) -> list[SweepReport]:
        for node, thread in self._threads:  # each sweep bounds itself; the margin covers thread start
            thread.join(sweep_limit(node, self.grace) + 5)
        return list(self._reports)


def sweep_notices(reports: list[SweepReport], orphan_timeout: float, back: frozenset[str] = frozenset()) -> list[str]:
    """How each sweep of a lost node went, as the job's notices say it; ``back``: the nodes that
    answered again afterwards and ran a later attempt of the run (an elastic run's, a restart's)."""
    notices = []
    for report in reports:
        if report.error and report.node.label in back:
            notices.append(f"{report.node.label}: when it was lost, its cleanup could not be confirmed ({report.error}); "
                           "it answered again afterwards, and ran a later attempt")
        elif report.error:
            notices.append(f"{report.node.label}: cleanup not confirmed ({report.error}); its agent stops the job by "
                           f"itself within orphan_timeout ({orphan_timeout:g} s), or run ddp-kill")
        elif report.found:
            notices.append(f"{report.node.label}: swept {len(report.found)} leftover process(es)")
    return notices
