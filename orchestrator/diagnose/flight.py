"""Which collective a job is stuck in, read from every rank's Flight Recorder record.

The nodes send each rank's last collectives (wire.Collectives, node/watch/flight.py) after a stack dump
and at an attempt's end. Per process group, the collective the ranks wait in is the one most of
them have called and not completed; a rank whose record stops before it never entered it. At
the same sequence number, ranks that called a different op, or the same op on other sizes or
dtypes, are a mismatch: that hangs with identical-looking stacks deep inside torch. The result
is one short paragraph (``Diagnosis.text``), for the console, summary.json and the run's logs.

Every field came from the job (a rank may write anything into its record): each is checked here,
and an entry that is not what it should be is dropped. Pure: no I/O.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable, NamedTuple

from ..clean import safe_text
from ..node.protocol.policy import rank_list
from ..node.protocol.stragglers import Lateness, LateWatch

# a collective's wait ended a rank (gloo's, NCCL's watchdog, c10d's): in its stderr, or its failure's words
TIMED_OUT = re.compile(r"Timed out waiting \d+ ?ms|Watchdog caught collective operation timeout|"
                       r"DistBackendError.*[Tt]ime ?out")
# ops whose inputs are the same size on every rank (others, such as all_to_all, may differ by design)
SAME_SIZES = {"all_reduce", "allreduce", "broadcast", "reduce", "all_gather", "allgather", "_allgather_base",
              "all_gather_into_tensor", "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor",
              "allreduce_coalesced", "barrier"}
MAX_ENTRIES = 64  # a rank's entries kept from one frame
MAX_GROUPS = 3  # process groups named in a paragraph


class Entry(NamedTuple):
    """One collective of one rank, as its Flight Recorder kept it."""

    group: str
    desc: str
    seq: int
    op: str
    done: bool
    in_sizes: tuple
    in_dtypes: tuple
    out_sizes: tuple
    out_dtypes: tuple
    called: float | None  # wall clock, seconds

    @property
    def signature(self) -> tuple:
        return (self.op, self.in_dtypes, self.in_sizes if self.op in SAME_SIZES else None)

    def describe(self) -> str:
        sizes = " ".join(f"[{', '.join(map(str, s))}]" if isinstance(s, tuple) else str(s) for s in self.in_sizes)
        return " ".join(p for p in (self.op, sizes, " ".join(map(str, self.in_dtypes))) if p)


def _text(value: object) -> str | None:
    return safe_text(value[:64]) if isinstance(value, str) else None


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 63 else None


def _shapes(value: object) -> tuple | None:
    if not isinstance(value, list) or len(value) > 8:
        return None
    out = []
    for v in value:
        if isinstance(v, str):
            out.append(safe_text(v[:32]))
        elif isinstance(v, list) and len(v) <= 8 and all(_int(d) is not None for d in v):
            out.append(tuple(v))
        else:
            return None
    return tuple(out)


def entry(raw: object) -> Entry | None:
    """A frame's entry ([group, desc, seq, op, done, in sizes, in dtypes, out sizes, out dtypes,
    called ns]) as an Entry; None if any field is not what it should be."""
    if not isinstance(raw, list) or len(raw) != 10:
        return None
    group, desc, op, seq = _text(raw[0]), _text(raw[1]), _text(raw[3]), _int(raw[2])
    shapes = [_shapes(v) for v in raw[5:9]]
    called = _int(raw[9])
    if None in (group, desc, op, seq) or not isinstance(raw[4], bool) or None in shapes:
        return None
    return Entry(group, desc, seq, op, raw[4], *shapes, None if called is None else called / 1e9)


def parse(ranks: object, allowed: range) -> dict[int, list[Entry]]:
    """A Collectives frame's ranks, those of the node that sent it only: {rank: entries by seq}."""
    found: dict[int, list[Entry]] = {}
    if not isinstance(ranks, dict):
        return found
    for key, raws in ranks.items():
        if isinstance(key, str) and key.isascii() and key.isdigit() and int(key) in allowed and isinstance(raws, list):
            entries = [e for e in map(entry, raws[-MAX_ENTRIES:]) if e is not None]
            if entries:
                found[int(key)] = sorted(entries, key=lambda e: (e.group, e.seq))
    return found


def group_name(e: Entry) -> str:
    if e.desc == "default_pg" or (e.group == "0" and e.desc in ("", "undefined")):
        return "the default group"
    return f"group {e.group}" + (f" ({e.desc})" if e.desc and e.desc != "undefined" else "")


@dataclass(frozen=True)
class GroupState:
    """One process group's collectives across the ranks that recorded any on it."""

    name: str
    completed: Entry | None  # the last collective every rank completed (None: not in every record)
    waiting: Entry | None  # the one the ranks are stuck in
    waiters: tuple[int, ...]
    absent: tuple[int, ...]  # ranks that never entered it
    mismatch: tuple[tuple[Entry, tuple[int, ...]], ...]  # at one seq: each signature and its ranks

    def sentence(self, where: Callable[[int], str]) -> str:
        parts = []
        if self.completed is not None:
            parts.append(f"every rank completed {self.completed.op} #{self.completed.seq}")
        if self.mismatch:
            seq = self.mismatch[0][0].seq
            calls = "; ".join(f"{rank_list(ranks)} ({where(ranks[0])}) {e.describe()}" for e, ranks in self.mismatch)
            parts.append(f"at #{seq} the ranks called different collectives: {calls}")
        if self.waiting is not None and self.absent:
            first = self.absent[0]
            who = f"{rank_list(self.absent)} ({where(first)}{', ...' if len(self.absent) > 1 else ''})"
            parts.append(f"{who} never entered {self.waiting.op} #{self.waiting.seq}; "
                         f"{rank_list(self.waiters)} {_verb(self.waiters)} in it")
        elif self.waiting is not None and not self.mismatch:
            parts.append(f"{rank_list(self.waiters)} {_verb(self.waiters)} in {self.waiting.op} #{self.waiting.seq}")
        return f"on {self.name}, " + "; ".join(parts) if parts else ""

    def blame(self) -> tuple[tuple[int, ...], str] | None:
        """The ranks the others wait for, and why, in a few words: those that never entered the
        collective, else those that called another one (the fewest alike)."""
        if self.waiting is not None and self.absent:
            return self.absent, f"never entered {self.waiting.op} #{self.waiting.seq} on {self.name}"
        sizes = sorted(len(ranks) for _, ranks in self.mismatch)
        if self.mismatch and sizes[0] < sizes[1]:  # as many on each side: no telling which is odd
            odd = min(self.mismatch, key=lambda m: len(m[1]))
            return odd[1], (f"called {odd[0].op} #{odd[0].seq} on {self.name} where the others called "
                            f"{next(e.op for e, ranks in self.mismatch if ranks != odd[1])}")
        return None


def _verb(ranks: tuple[int, ...]) -> str:
    return "waits" if len(ranks) == 1 else "wait"


def group_state(by_rank: dict[int, list[Entry]]) -> GroupState:
    """What ``by_rank`` (one group's entries per rank) says."""
    done = [max((e.seq for e in es if e.done), default=None) for es in by_rank.values()]
    last = min(done) if None not in done else None
    completed = next((e for es in by_rank.values() for e in es if e.seq == last), None)
    pending = {r: min(e.seq for e in es if not e.done) for r, es in by_rank.items() if any(not e.done for e in es)}
    if not pending:
        return GroupState(group_name(next(iter(by_rank.values()))[0]), completed, None, (), (), ())
    seq = Counter(pending.values()).most_common()[0][0]
    at_seq = {r: next(e for e in es if e.seq == seq) for r, es in by_rank.items() if any(e.seq == seq for e in es)}
    waiters = tuple(sorted(r for r, s in pending.items() if s == seq))
    absent = tuple(sorted(r for r, es in by_rank.items() if r not in at_seq and max(e.seq for e in es) < seq))
    kinds: dict[tuple, list[int]] = {}
    for r, e in sorted(at_seq.items()):
        kinds.setdefault(e.signature, []).append(r)
    mismatch = tuple((at_seq[ranks[0]], tuple(ranks)) for ranks in kinds.values()) if len(kinds) > 1 else ()
    waiting = Counter(at_seq[r] for r in waiters).most_common()[0][0] if waiters else None
    name = group_name(next(iter(at_seq.values()), by_rank[waiters[0]][0]))
    return GroupState(name, completed, waiting, waiters, absent, mismatch)


@dataclass(frozen=True)
class Diagnosis:
    text: str  # the paragraph
    records: dict  # {rank: [Entry]}: what it was read from (the run's logs keep one file per rank)
    blamed: tuple[tuple[int, ...], str] | None = None  # the ranks everyone waits for, and why (GroupState.blame)


def diagnose(records: dict[int, list[Entry]], where: Callable[[int], str], world: int | None = None) -> Diagnosis | None:
    """The paragraph for a job that hung or timed out, from every rank's last collectives (None
    without any record). ``where(rank)``: the rank's node, as the cluster file names it."""
    if not records:
        return None
    groups: dict[str, dict[int, list[Entry]]] = {}
    for rank, entries in records.items():
        for e in entries:
            groups.setdefault(e.group, {}).setdefault(rank, []).append(e)
    states = [group_state(g) for _, g in sorted(groups.items())]
    stuck = sorted((s for s in states if s.waiting is not None),
                   key=lambda s: (not s.absent and not s.mismatch, s.name != "the default group"))
    silent = sorted(set(range(world)) - set(records)) if world else []
    parts = [s.sentence(where) for s in stuck[:MAX_GROUPS]]
    if not stuck:
        parts = [s.sentence(where) for s in states if s.name == "the default group"]
        parts.append("no rank waits in a collective (the hang is elsewhere: see the stacks)")
    if silent:
        parts.append(f"no record from {rank_list(silent)}")
    blamed = next((b for b in (s.blame() for s in stuck) if b is not None), None)
    return Diagnosis("Flight Recorder: " + "; ".join(p for p in parts if p) + ".", records, blamed)


class FlightLog:
    """What the nodes sent of their ranks' collectives in one attempt: each rank's latest record
    (for a diagnosis at the end) and every node's lateness (stragglers.py)."""

    def __init__(self, nodes: int, world: int):
        self.world = world
        self.records: dict[int, list[Entry]] = {}
        self.late = LateWatch(nodes) if nodes > 1 else None
        self.timed_out: set[int] = set()  # the ranks that said a collective's wait ended them

    def lines(self, lines: Iterable) -> None:
        """The ranks' lines (events.LogLine), for their word of a collective's timeout."""
        for line in lines:
            if line.rank is not None and line.stream == "err" and len(self.timed_out) < self.world \
                    and line.rank not in self.timed_out and TIMED_OUT.search(line.text[:2000]):
                self.timed_out.add(line.rank)

    def collectives(self, ranks: object, allowed: range) -> None:
        self.records.update(parse(ranks, allowed))

    def arrivals(self, node: int, times: object, clock: Callable[[float], float]) -> list[Lateness]:
        return self.late.arrivals(node, times, clock) if self.late is not None else []

    def figures(self) -> tuple[Lateness, ...]:
        return tuple(self.late.figures()) if self.late is not None else ()

    def marks(self) -> dict[int, str]:
        return self.late.marks() if self.late is not None else {}

    def diagnosis(self, failures: Iterable, where: Callable[[int], str]) -> Diagnosis | None:
        """The paragraph, for a job that hung or whose failure a timeout names (a collective's,
        most likely: in its words, or in what the failed rank itself printed); None for any
        other end (a rank that merely printed the words does not make a failure a timeout)."""
        if not failures or not any(f.kind == "hung" or f.rank in self.timed_out or
                                   TIMED_OUT.search(f"{f.what} {f.exception or ''}") for f in failures):
            return None
        return diagnose(self.records, where, self.world)

    def blamed(self) -> tuple[tuple[int, ...], str] | None:
        """For a hang being named: the ranks the records say everyone waits for, and why."""
        found = diagnose(self.records, str, self.world)
        return found.blamed if found is not None else None
