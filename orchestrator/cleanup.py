"""Find and stop tagged job processes on nodes: ddp-kill, and the job's fallback for lost nodes.

Runs the same agent as a launch, in ``sweep`` mode: it matches processes by the tags ddp-up put
in their environment (job, node, cluster file), never by name or command line.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from . import protocol
from .agent import TAG_CLUSTER, TAG_JOB, TAG_NODE
from .config import NodeConfig
from .transport import ConnectFailed, Transport, transport_for


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
    report = SweepReport(node)
    transport = transport or transport_for(node)
    spec = {"mode": "sweep", "match": match, "grace": grace, "dry_run": dry_run}
    try:
        transport.connect()
        proc = transport.start(node.python, protocol.bootstrap_args(), {})
    except ConnectFailed as e:
        report.error = e.problem.what
        return report
    limit = timeout if timeout is not None else grace + node.ssh.connect_timeout + 15
    reader = threading.Thread(target=_collect, args=(proc, spec, report), daemon=True)
    reader.start()
    reader.join(limit)
    if reader.is_alive():
        report.error = f"no report within {limit:.0f} s"
    proc.close()
    transport.close()
    return report


def _collect(proc, spec: dict, report: SweepReport) -> None:
    try:
        proc.write(protocol.hello(spec))
    except OSError:
        pass
    reader = protocol.FrameReader()
    got_exit = False
    while chunk := proc.read_stdout():
        for kind, payload in reader.feed(chunk):
            data = protocol.decode_json(payload)
            if kind == b"L":
                report.hostname = data.get("hostname", "")
                report.found = data.get("found", [])
            elif kind == b"X":
                report.killed, report.left, got_exit = data.get("killed", []), data.get("left", []), True
    if not got_exit and report.error is None:
        status = proc.exit_status(timeout=1.0)
        report.error = f"the agent ended without a report (exit status {status})"


def sweep_nodes(nodes: list[NodeConfig], match_of, grace: float, dry_run: bool = False) -> list[SweepReport]:
    """Sweep many nodes in parallel; ``match_of(node)`` gives each node's tag filter."""
    if not nodes:
        return []
    with ThreadPoolExecutor(max_workers=min(64, len(nodes))) as pool:
        return list(pool.map(lambda n: sweep_node(n, match_of(n), grace, dry_run), nodes))
