"""Every line of every rank on the controller: ``runs/<job-id>/`` with one file per node, one per
global rank, and ``summary.json``. Not filtered by --ranks or --collapse: the files keep all."""

from __future__ import annotations

import json
import os
import re
import time
from datetime import datetime, timezone
from typing import IO

from ..events import LogLine
from ..plan import LaunchPlan, NodePlan

SEPARATOR = {"out": "|", "err": "!", "node": "~"}


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)


def _iso(wall: float | None) -> str | None:
    return None if wall is None else datetime.fromtimestamp(wall, timezone.utc).isoformat()


class RunLogs:
    def __init__(self, plan: LaunchPlan, root: str, wall=time.time):
        self.plan = plan
        self.dir = os.path.join(root, plan.job_id)
        self.wall = wall
        self.started = wall()
        self.node_started: dict[int, float] = {}
        self.node_ended: dict[int, float] = {}
        os.makedirs(self.dir, exist_ok=True)
        self.node_files: dict[int, IO[str]] = {}
        self.rank_files: dict[int, IO[str]] = {}

    def _node_file(self, node: NodePlan) -> IO[str]:
        f = self.node_files.get(node.index)
        if f is None:
            name = f"node{node.index}-{_safe(node.label)}.log"
            f = self.node_files[node.index] = open(os.path.join(self.dir, name), "a", encoding="utf-8")
        return f

    def _rank_file(self, rank: int) -> IO[str]:
        f = self.rank_files.get(rank)
        if f is None:
            f = self.rank_files[rank] = open(os.path.join(self.dir, f"rank{rank}.log"), "a", encoding="utf-8")
        return f

    def __enter__(self) -> RunLogs:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Idempotent: the files of a job that ended before ``finished`` are closed too."""
        for f in (*self.node_files.values(), *self.rank_files.values()):
            f.close()

    # --- view protocol ---

    def lines(self, node: NodePlan, lines: list[LogLine]) -> None:
        nf = self._node_file(node)
        nf.writelines(f"{'r' + str(l.rank) if l.rank is not None else '-'} {SEPARATOR[l.stream]} {l.text}\n"
                      for l in lines)
        by_rank: dict[int, list[str]] = {}
        for line in lines:
            if line.rank is not None:
                by_rank.setdefault(line.rank, []).append(line.text + "\n")
        for rank, texts in by_rank.items():  # one write per rank and batch, not per line
            self._rank_file(rank).writelines(texts)

    def node_state(self, status) -> None:
        if status.state == "starting":
            self.node_started.setdefault(status.plan.index, self.wall())
        if status.terminal:
            self.node_ended.setdefault(status.plan.index, self.wall())

    def notice(self, text: str) -> None:
        pass

    def tick(self, snapshot) -> None:
        pass

    def finished(self, result, exit_code: int | None = None) -> None:
        self.close()
        with open(os.path.join(self.dir, "summary.json"), "w", encoding="utf-8") as f:
            json.dump(self.summary(result, result.exit_code if exit_code is None else exit_code), f, indent=2)
            f.write("\n")

    def summary(self, result, exit_code: int) -> dict:
        root = result.root_cause
        return {
            "job_id": self.plan.job_id,
            "master": f"{self.plan.master_addr}:{result.master_port}",
            "world_size": self.plan.world_size,
            "script": self.plan.script,
            "args": list(self.plan.script_args),
            "started": _iso(self.started),
            "ended": _iso(self.wall()),
            "exit_code": exit_code,
            "interrupted_by": result.interrupted,
            "root_cause": None if root is None else {
                "node": root.node, "host": root.label, "rank": root.rank, "exit_code": root.exit_code,
                "what": root.what, "at": _iso(root.at)},
            "nodes": [{
                "node": s.plan.index, "host": s.plan.label, "ranks": [s.plan.ranks.start, s.plan.ranks.stop - 1],
                "state": s.state, "exit_code": s.exit_code, "signal": s.signal, "reason": s.reason,
                "lines": s.lines, "started": _iso(self.node_started.get(s.plan.index)),
                "ended": _iso(self.node_ended.get(s.plan.index))} for s in result.nodes],
        }
