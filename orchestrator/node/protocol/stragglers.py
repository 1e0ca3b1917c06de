"""Which node arrives late at the job's collectives, while the job runs.

Each node's agent says, for the collectives every rank of it called, when its last rank called
it (wire.Arrivals, from the ranks' Flight Recorder records; node/watch/flight.py). Once every running
node has said so for one collective, the last node to arrive is late by how long after the
median of the others it came. A node is a straggler when it was the last, and at least LATE_MIN
late, at SHARE or more of the last WINDOW collectives (LEAST at the fewest): in a balanced job
the last one changes from one collective to the next and is late by little, so no one is named.

Shared by ddp-up and a detached job's supervisor (node/supervise/supervisor.py), so stdlib only. The times
are the nodes' wall clocks; ddp-up corrects them by the offset measured at preflight where it is
large (rankfailures.node_clock): a lateness below the clocks' agreement (NTP: a few ms) is not
told apart from it. Only collectives that every node takes part in are compared. Pure: no I/O.
"""

from __future__ import annotations

from collections import Counter, deque, namedtuple

LATE_MIN = 0.05  # seconds after the others' median: less is noise
SHARE = 0.6  # of the collectives compared, the share a straggler is late at
WINDOW = 200  # collectives compared (the latest)
LEAST = 10  # collectives compared before anyone is named
PENDING_MAX = 4096  # collectives waiting for every node's word; the oldest are dropped past it


def median(values):
    """The middle value (the mean of the two middle ones), of one or more numbers (no
    ``statistics``: every node's agent loads this module, and that import would cost its start)."""
    ordered = sorted(values)
    half = len(ordered) // 2
    return ordered[half] if len(ordered) % 2 else (ordered[half - 1] + ordered[half]) / 2


# One node's figures over the collectives compared: how many it was the last to by LATE_MIN or
# more (late_at), its median lateness (s) at those, and its rank that arrived last most often there.
class Lateness(namedtuple("Lateness", "node compared late_at late rank")):
    __slots__ = ()

    @property
    def share(self) -> float:
        return self.late_at / self.compared if self.compared else 0.0

    @property
    def straggler(self) -> bool:
        return self.compared >= LEAST and self.share >= SHARE

    def text(self) -> str:
        return "late %.0f ms at %.0f%% of collectives" % (self.late * 1000, self.share * 100)

    def how(self) -> str:
        """Why it is named, for the notice and the ``straggler`` event (ddp-up's and a detached
        job's supervisor's)."""
        return "rank %s arrives last at %.0f%% of the job's collectives, %.0f ms after the others" % (
            self.rank, self.share * 100, self.late * 1e3)

    def as_dict(self) -> dict:
        return {"compared": self.compared, "late_at": self.late_at, "late_ms": round(self.late * 1000, 1),
                "rank": self.rank, "straggler": self.straggler}


class LateWatch:
    def __init__(self, nodes: int):
        self.nodes = nodes
        self.pending: dict[tuple, dict[int, tuple[float, int]]] = {}  # (group, seq) -> {node: (when, rank)}
        self.history: dict[int, deque] = {n: deque(maxlen=WINDOW) for n in range(nodes)}  # (late, rank) or None
        self.named: set[int] = set()  # nodes already announced as stragglers

    def arrivals(self, node: int, times: object, clock) -> list[Lateness]:
        """An Arrivals frame's times (untrusted: odd entries are skipped); the nodes that have just
        become stragglers, for a notice (each once)."""
        for item in times if isinstance(times, list) else ():
            if not (isinstance(item, list) and len(item) == 4 and isinstance(item[0], str)
                    and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in item[1:])):
                continue
            key = (item[0][:64], item[1])
            self.pending.setdefault(key, {})[node] = (clock(float(item[2])), int(item[3]))
            if len(self.pending[key]) == self.nodes:
                self.compare(self.pending.pop(key))
        while len(self.pending) > PENDING_MAX:
            del self.pending[next(iter(self.pending))]
        new = [f for f in self.figures() if f.straggler and f.node not in self.named]
        self.named.update(f.node for f in new)
        return new

    def compare(self, arrived: dict[int, tuple[float, int]]) -> None:
        last = max(arrived, key=lambda n: arrived[n][0])
        others = [t for n, (t, _) in arrived.items() if n != last]
        late = arrived[last][0] - median(others)
        for node in self.history:
            hit = node == last and late >= LATE_MIN
            self.history[node].append((late, arrived[last][1]) if hit else None)

    def figures(self) -> list[Lateness]:
        out = []
        for node, seen in self.history.items():
            hits = [h for h in seen if h is not None]
            rank = Counter(r for _, r in hits).most_common(1)[0][0] if hits else None
            out.append(Lateness(node, len(seen), len(hits), median(l for l, _ in hits) if hits else 0.0, rank))
        return out

    def marks(self) -> dict[int, str]:
        """{node: "late 180 ms at 92% of collectives"} for the nodes that straggle now."""
        return {f.node: f.text() for f in self.figures() if f.straggler}
