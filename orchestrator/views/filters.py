"""Console-side filters: which ranks to show, and collapsing lines every rank prints. Pure."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..errors import EXIT_USAGE, DdpUpError


class RankSpecError(DdpUpError):
    exit_code = EXIT_USAGE


def parse_ranks(spec: str, world_size: int) -> frozenset[int]:
    """``'0,3-5'`` -> {0, 3, 4, 5}; every rank must exist in the job."""
    ranks: set[int] = set()
    for part in spec.split(","):
        # ASCII digits, at most 9 of them: a rank is never larger, and int() refuses 4,300 digits
        m = re.fullmatch(r"\s*([0-9]{1,9})\s*(?:-\s*([0-9]{1,9})\s*)?", part)
        if not m:
            raise RankSpecError(f"--ranks {spec[:80]!r}: expected a list like 0,3-5")
        low, high = int(m.group(1)), int(m.group(2) or m.group(1))
        if low > high or high >= world_size:
            raise RankSpecError(f"--ranks {spec[:80]!r}: ranks run from 0 to {world_size - 1}")
        ranks.update(range(low, high + 1))
    return frozenset(ranks)


def format_ranks(ranks) -> str:
    """{0, 1, 2, 5} -> ``'0-2,5'``."""
    out, run = [], []
    for r in sorted(ranks):
        if run and r == run[-1] + 1:
            run.append(r)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [r]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


@dataclass
class _Pending:
    first_seen: float
    ranks: set[int] = field(default_factory=set)


class Collapser:
    """Holds ranked lines briefly; a line every rank printed comes out once, with its ranks.

    A line is released when all ranks printed it, when ``window`` seconds pass, or when the same
    rank prints it again (so a rank's own repeated lines are never merged away). Release order
    is first-seen order, so the output stays in each rank's order.
    """

    def __init__(self, world_size: int, window: float = 0.5):
        self.world_size = world_size
        self.window = window
        self.pending: dict[tuple[str, str], _Pending] = {}

    def add(self, stream: str, rank: int, text: str, now: float) -> list[tuple[str, frozenset[int], str]]:
        key = (stream, text)
        out = []
        entry = self.pending.get(key)
        if entry is not None and rank in entry.ranks:
            out = self._release(key)
            entry = None
        if entry is None:
            entry = self.pending[key] = _Pending(now)
        entry.ranks.add(rank)
        if len(entry.ranks) == self.world_size:
            out += self._release(key)
        return out

    def due(self, now: float, everything: bool = False) -> list[tuple[str, frozenset[int], str]]:
        out = []
        for key, entry in list(self.pending.items()):
            if everything or now - entry.first_seen >= self.window:
                out += self._release(key)
        return out

    def _release(self, key: tuple[str, str]) -> list[tuple[str, frozenset[int], str]]:
        entry = self.pending.pop(key)
        return [(key[0], frozenset(entry.ranks), key[1])]
