"""Parsing what torchrun and the workers print: the failure report, stack dumps. Pure."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime

from ..node.flight import RECORDER_FRAME

_FIELD = re.compile(r"^\s*(time|host|rank|exitcode)\s*:\s*(.*)$")
_ENTRY = re.compile(r"^\s*\[\d+\]:\s*$")
# torchrun, when a worker outlived its shutdown timeout (set to stop_grace) and got SIGKILL
_FORCED = re.compile(r"Unable to shutdown process \d+ via \S+, forcefully exiting via")


@dataclass(frozen=True)
class WorkerFailure:
    """One entry of torchrun's failure report (its root cause, or one of its other failures)."""

    rank: int | None
    exit_code: int | None
    host: str | None
    time: float | None  # wall clock of the failure on the node, to the second, if reported


class FailureReportParser:
    """Fed the launcher's own (unranked) lines; remembers the report's root cause and every
    failed rank it lists (``failed``: {global rank: its entry}), and counts the workers it killed
    when their stop took longer than its shutdown timeout."""

    def __init__(self) -> None:
        self._in_report = False
        self._in_root = False
        self._fields: dict[str, str] = {}
        self.root: WorkerFailure | None = None
        self.failed: dict[int, WorkerFailure] = {}
        self.forced = 0  # workers torchrun killed at the end of its shutdown timeout (stop_grace)

    def feed(self, text: str) -> None:
        if _FORCED.search(text):
            self.forced += 1
        if text.startswith("Failures:") or "Root Cause (first observed failure)" in text:
            self._in_report, self._in_root, self._fields = True, "Root Cause" in text, {}
            return
        if not self._in_report:
            return
        m = _FIELD.match(text)
        if m:
            self._fields[m.group(1)] = m.group(2).strip()
            if m.group(1) == "exitcode":
                self.entry(_failure(self._fields))
        elif _ENTRY.match(text):
            self._fields = {}
        elif text.startswith("====="):
            self._in_report = self._in_root = False

    def entry(self, failure: WorkerFailure) -> None:
        if failure.rank is not None:
            self.failed[failure.rank] = failure
        if self._in_root:
            self.root = failure


def _failure(fields: dict[str, str]) -> WorkerFailure:
    rank = re.match(r"(-?\d+)", fields.get("rank", ""))
    code = re.match(r"(-?\d+)", fields.get("exitcode", ""))
    return WorkerFailure(
        rank=int(rank.group(1)) if rank else None,
        exit_code=int(code.group(1)) if code else None,
        host=fields.get("host"),
        time=_timestamp(fields.get("time", "")),
    )


def _timestamp(text: str) -> float | None:
    try:
        return datetime.fromisoformat(text.replace("_", "T", 1)).timestamp()
    except ValueError:
        return None


_FRAME = re.compile(r'^\s*File "([^"]+)", line \d+ in (\S+)')  # faulthandler
_SPY_FRAME = re.compile(r"^\s+(\S+) \(([^()]+):\d+\)$")  # py-spy dump: "    func (path/file.py:12)"
_SPY_MAIN = re.compile(r'^Thread \d+ \(\w+\): "MainThread"')
# torch.distributed, and DDP's own collectives (its bucket rebuild is a broadcast, its sync a reduce)
_DISTRIBUTED = re.compile(r"(^|/)torch/(distributed/|nn/parallel/distributed\.py)")
_TORCH = re.compile(r"(^|/)torch/")


class StackReport:
    """Reads stack dumps (faulthandler's, or py-spy's main thread; most recent call first) from
    ranks' stderr lines.

    For each rank it keeps the innermost torch.distributed function (the collective it waits
    in, if any) and the innermost frame outside torch (the user's code that got there).
    """

    def __init__(self) -> None:
        self.collective: dict[int, str | None] = {}
        self.where: dict[int, str] = {}

    def feed(self, rank: int, text: str) -> None:
        if rank not in self.where and ("(most recent call first)" in text or _SPY_MAIN.match(text)):
            self.collective.setdefault(rank, None)  # a dump begins (faulthandler; py-spy's main thread)
            return
        if rank not in self.collective or rank in self.where:
            return
        m = _FRAME.match(text)
        if m:
            path, function = m.groups()
        elif (m := _SPY_FRAME.match(text)):
            function, path = m.groups()
        else:
            return
        if path.endswith("sitecustomize.py") and function == RECORDER_FRAME:  # ddp-up's own recorder thread
            del self.collective[rank]  # (node/flight.py): the next thread's dump is the rank's
            return
        if _DISTRIBUTED.search(path):
            if self.collective[rank] is None and function != "wrapper":
                self.collective[rank] = function
        elif not _TORCH.search(path):
            self.where[rank] = function

    def odd_ones_out(self) -> list[int]:
        """The smallest group of ranks by the collective they wait in (None: in none)."""
        groups: dict[str | None, list[int]] = {}
        for rank, collective in self.collective.items():
            groups.setdefault(collective, []).append(rank)
        if len(groups) < 2:
            return []
        return sorted(min(groups.values(), key=lambda ranks: (len(ranks), ranks)))

    def describe(self, rank: int) -> str:
        collective = self.collective.get(rank)
        where = self.where.get(rank, "?")
        return f"in {collective} (from {where})" if collective else f"not in a collective ({where})"
