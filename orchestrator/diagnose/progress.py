"""How far each node is: what its progress bar says (tqdm's format, or Rich's as Lightning's
RichProgressBar draws it), its rate, its ETA, and whether it goes well below the others' pace.
Pure: values in, values out.

A node's bar is its chosen rank's (``chosen_rank``): the first of ``--ranks`` on the node, else
rank 0 where the node has it, else the node's first rank. Its rows arrive in Bars frames
(node/watch/screen.py); the first row that reads as progress counts (tqdm's nested bars: the outer one,
whose end is the job's). A script without tqdm reports progress with a line of its own::

    progress: 450/1000

(``progress`` at the start of the line, then ``N/TOTAL``); ddp-up measures the rate itself.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import Counter, deque
from dataclasses import dataclass
from typing import Iterable, NamedTuple

BAR_EVERY = 10.0  # seconds between a bar's snapshots as lines (plain console, log files); its end is a line too
SLOWER = 0.8  # a node at this share of the others' median rate, or less, is marked slow
RATE_SPAN = 30.0  # seconds of a node's own samples its measured rate is taken over

_SCALE = {"": 1.0, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
# Every repeat is bounded: a run of 20,000 digits took the unbounded pattern ~50 s (each start in
# the run tried the whole run); bounded, and tried only where a number starts, a row is read in
# time linear in its length. A rank's
# text is the job's: whatever it prints, reading it never raises (read() says None instead).
_NUM = r"(\d{1,15}(?:\.\d{1,15})?)([kMGTP]?)"
_CLOCK = r"(\d{1,6}(?::\d{1,2}){0,2})"
# tqdm's right part: "| 450/1000 [00:12<00:15, 36.20it/s]", "4.50k/10.0k [01:02<?, ?B/s]", "1.23s/it", a postfix
TQDM = re.compile(r"(?<![\d.])" + _NUM + r"/" + _NUM + r"\s{0,4}\[" + _CLOCK + r"<(" + _CLOCK[1:-1] + r"|\?)(?:,\s{0,4}(?:" + _NUM +
                  r"|\?)\s{0,4}([^\s,\]/]{0,16})/([^\s,\]]{1,16}))?")
OWN = re.compile(r"progress:?\s{1,4}" + _NUM + r"/" + _NUM + r"\b")
# Rich's, as Lightning's RichProgressBar draws it: "Epoch 3/9 ━━━━ 12/40 0:00:01 • 0:00:03 9.87it/s"
RICH = re.compile(r"(?<![\d.])(\d{1,15})/(\d{1,15})\s{1,4}\d{1,6}:\d\d:\d\d\s{1,4}\u2022\s{1,4}"
                  r"(\d{1,6}:\d\d:\d\d|-:--:--)(?:\s{1,4}(\d{1,15}(?:\.\d{1,15})?)it/s)?")
ROW_READ = 4096  # characters of a row read for progress: tqdm's figures are within them


class Snapshots:
    """When a bar may be written again as a line (plain console, log files): at most every
    BAR_EVERY seconds for each key; and which of the rows last written the stream then finished as
    lines. A row below which the cursor went on is a line until SETTLE says otherwise
    (node/watch/screen.py), and in that moment it is one of the bar's rows: a DataLoader worker's
    print under Rich's live bar, drawn above the bar by the worker's own copy of it. Written with
    the snapshot, it is not written again when it comes as the line it was."""

    def __init__(self) -> None:
        self.last: dict[tuple, float] = {}
        self.rows: dict[tuple, Counter] = {}  # (key, rank): the rows the last snapshot wrote, not yet seen as lines

    def due(self, key: tuple, now: float) -> bool:
        if now - self.last.get(key, -BAR_EVERY) < BAR_EVERY:
            return False
        self.last[key] = now
        return True

    def wrote(self, key: tuple, rank: int, rows: Iterable[str]) -> None:
        self.rows[key, rank] = Counter(rows)

    def written(self, key: tuple, rank: int | None, text: str) -> bool:
        """Whether a line of ``rank``'s is a row the last snapshot wrote (once each)."""
        rows = self.rows.get((key, rank))
        if not rows or not rows[text]:
            return False
        rows[text] -= 1
        return True


class Bar(NamedTuple):
    """What one rank's stream draws now (its rows, top first; none: nothing drawn there)."""

    stream: str
    rank: int
    rows: tuple[str, ...]


@dataclass(frozen=True)
class Reading:
    """One progress figure read from a bar or a line."""

    n: float
    total: float
    rate: float | None = None  # items per second, as the bar says
    unit: str = "it"
    remaining: float | None = None  # seconds, as the bar says

    @property
    def share(self) -> float:
        return self.n / self.total if self.total else 0.0


def _number(digits: str, scale: str) -> float:
    return float(digits) * _SCALE[scale]


def _clock(text: str) -> float:
    seconds = 0.0
    for part in text.split(":"):
        seconds = seconds * 60 + float(part)
    return seconds


def read(text: str) -> Reading | None:
    """The progress a bar's row (tqdm's format) or a ``progress: N/TOTAL`` line says, if any;
    None for anything else, whatever it is."""
    try:
        reading = _read(text[:ROW_READ])
    except (ValueError, ArithmeticError):
        return None
    if reading is None or not all(map(math.isfinite, (reading.n, reading.total, reading.rate or 0.0,
                                                         reading.remaining or 0.0))):
        return None
    return reading


def _read(text: str) -> Reading | None:
    m = TQDM.search(text)
    if m is not None:
        n, total = _number(m.group(1), m.group(2)), _number(m.group(3), m.group(4))
        rate, unit = None, m.group(9) or "it"
        if m.group(7) is not None:
            rate = _number(m.group(7), m.group(8))
            if m.group(10) not in ("s", "sec") and unit in ("s", "sec"):  # "1.23s/it": seconds per item
                rate, unit = (1.0 / rate if rate else None), m.group(10)
        remaining = None if m.group(6) == "?" else _clock(m.group(6))
        return Reading(n, total, rate, unit, remaining) if total else None
    m = RICH.search(text)
    if m is not None:
        total = float(m.group(2))
        remaining = None if m.group(3).startswith("-") else _clock(m.group(3))
        return Reading(float(m.group(1)), total, float(m.group(4)) if m.group(4) else None, "it", remaining) \
            if total else None
    m = OWN.match(text)
    if m is not None:
        total = _number(m.group(3), m.group(4))
        return Reading(_number(m.group(1), m.group(2)), total) if total else None
    return None


def chosen_rank(ranks: range, wanted: frozenset[int] | None) -> int:
    """The rank whose bar a node shows."""
    if wanted:
        mine = sorted(r for r in wanted if r in ranks)
        if mine:
            return mine[0]
    return ranks.start


class NodePace:
    """One node's latest reading, and the samples its rate is measured from."""

    def __init__(self) -> None:
        self.rows: tuple[str, ...] = ()
        self.reading: Reading | None = None
        self.seen = 0.0
        self.samples: deque[tuple[float, float]] = deque()

    def take(self, reading: Reading, now: float) -> None:
        if self.reading is not None and (reading.total != self.reading.total or reading.n < self.reading.n):
            self.samples.clear()  # another bar (the next epoch's): its own pace
        self.reading, self.seen = reading, now
        self.samples.append((now, reading.n))
        while len(self.samples) > 2 and now - self.samples[0][0] > RATE_SPAN:
            self.samples.popleft()

    def rate(self) -> float | None:
        if self.reading is not None and self.reading.rate is not None:
            return self.reading.rate
        if len(self.samples) < 2 or self.samples[-1][0] - self.samples[0][0] < 1.0:
            return None
        (t0, n0), (t1, n1) = self.samples[0], self.samples[-1]
        return (n1 - n0) / (t1 - t0)

    def eta(self, now: float) -> float | None:
        r = self.reading
        if r is None:
            return None
        if r.remaining is not None:
            return max(0.0, r.remaining - (now - self.seen))
        rate = self.rate()
        return max(0.0, (r.total - r.n) / rate - (now - self.seen)) if rate else None

    def text(self, now: float) -> str:
        """``45% 36.2it/s eta 0:15``."""
        r = self.reading
        if r is None:
            return ""
        rate, eta = self.rate(), self.eta(now)
        parts = [f"{r.share:.0%}"]
        if rate is not None:
            parts.append(f"{rate:.3g}{r.unit}/s")
        if eta is not None:
            parts.append(f"eta {duration(eta)}")
        return " ".join(parts)


LONGEST_SHOWN = 100 * 365 * 86400.0  # an ETA past this (a bar's own, or a crawl) shows as this


def duration(seconds: float) -> str:
    seconds = int(min(seconds, LONGEST_SHOWN)) if seconds == seconds else 0
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else \
        f"{seconds // 60}:{seconds % 60:02d}"


class ProgressBoard:
    """Every node's bar and pace; ``nodes``: each node's ranks (global), in node order."""

    def __init__(self, nodes: list[range], wanted: frozenset[int] | None = None):
        self.chosen = {index: chosen_rank(ranks, wanted) for index, ranks in enumerate(nodes)}
        self.pace = {index: NodePace() for index in range(len(nodes))}
        self.named: set[int] = set()  # nodes already announced as slow

    def bars(self, node: int, bars: Iterable[Bar], now: float) -> None:
        for bar in bars:
            if bar.rank != self.chosen.get(node):
                continue
            pace = self.pace[node]
            if bar.rows or bar.stream == "err" or not pace.rows:  # tqdm draws on stderr: it wins a tie
                pace.rows = bar.rows
            for row in bar.rows:
                reading = read(row)
                if reading is not None:
                    pace.take(reading, now)
                    break

    def lines(self, node: int, lines: Iterable, now: float) -> None:
        """A node's lines (events.LogLine; the hot path: only ``progress...`` lines of the chosen
        rank are read)."""
        chosen = self.chosen.get(node)
        for line in lines:
            if line.rank == chosen and line.text.startswith("progress"):
                reading = read(line.text)
                if reading is not None:
                    self.pace[node].take(reading, now)

    def cells(self, node: int, now: float) -> tuple[str, str]:
        """(the bar's rows as one line, ``45% 36.2it/s eta 0:15``) for the node's dashboard row."""
        pace = self.pace[node]
        return "  ".join(pace.rows), pace.text(now)

    def eta(self, now: float, running: Iterable[int]) -> float | None:
        """The job's: its slowest running node's."""
        etas = [e for e in (self.pace[n].eta(now) for n in running) if e is not None]
        return max(etas) if etas else None

    def slow(self, running: Iterable[int]) -> dict[int, str]:
        """{node: "0.61x"} for the running nodes well below the others' median rate (same unit)."""
        rates = {n: (self.pace[n].rate(), self.pace[n].reading) for n in running}
        rates = {n: (rate, reading.unit) for n, (rate, reading) in rates.items() if rate and reading is not None}
        found = {}
        for node, (rate, unit) in rates.items():
            others = [r for n, (r, u) in rates.items() if n != node and u == unit]
            median = statistics.median(others) if others else None
            if median and rate <= SLOWER * median:
                found[node] = f"{rate / median:.2f}x"
        return found

    def newly_slow(self, running: Iterable[int]) -> dict[int, str]:
        """The slow nodes not announced before (each once)."""
        new = {n: share for n, share in self.slow(running).items() if n not in self.named}
        self.named.update(new)
        return new
