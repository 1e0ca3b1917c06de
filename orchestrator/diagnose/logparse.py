"""Parsing what torchrun and the workers print: stack dumps and ddp-check's probe reports here;
torchrun's failure report in node/watch/report.py, which the nodes read too. Pure."""

from __future__ import annotations

import json
import re

from ..node.watch.flight import RECORDER_FRAME

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
            del self.collective[rank]  # (node/watch/flight.py): the next thread's dump is the rank's
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


def tagged_json(text: str, tag: str) -> dict | None:
    """The JSON object one of ddp-check's probes (the collective's, the GPUs') printed on a line
    after ``tag``, or None where the line is not one. The line is a rank's output: its fields are
    the caller's to check."""
    if not text.startswith(tag):
        return None
    try:
        found = json.loads(text[len(tag):])
    except ValueError:
        return None
    return found if isinstance(found, dict) else None
