"""Growing back: the nodes away from a run are asked whether they answer again.

Between two attempts (Asking, during the restart delay) a node that answers rejoins at once. While
an attempt runs smaller than the run started (Watch), the away nodes are asked every little while
in the background; once one has answered for `rejoin_after:` without a miss, the job is stopped
with its ranks' grace (they save) and the next attempt starts at the larger size (runloop.py).
A node must stay healthy that long because a stop costs the job its restart (a checkpoint's load,
the imports): a node that flaps would cost one each time.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from ..config.cluster import NodeConfig

ASK_EVERY = (2.0, 60.0)  # the least and the most seconds between two asks of the away nodes

# The labels of those nodes that answer (remote/detect.Answering); one with a ``cut()`` has the
# asks under way ended when a watch closes.
Prober = Callable[[list[NodeConfig]], "set[str]"]


def ask_every(rejoin_after: float) -> float:
    """Seconds between two asks: a few asks within rejoin_after, never more often than every 2 s
    (each one is an ssh connection and an agent's start), never less than once a minute."""
    least, most = ASK_EVERY
    return min(most, max(least, rejoin_after / 4))


def cut(prober: Prober) -> None:
    """End the asks under way, of a prober that can (detect.Answering.cut)."""
    getattr(prober, "cut", lambda: None)()


def answering(prober: Prober, nodes: list[NodeConfig]) -> set[str]:
    """``prober``'s answer; a prober that fails finds none (asking is a favour: the run goes on
    with the nodes it has)."""
    try:
        return set(prober(nodes))
    except Exception:  # noqa: BLE001
        return set()


class Asking:
    """``prober`` asked of ``nodes`` once, on a thread of its own: ``found`` (the labels that
    answered) once ``done``."""

    def __init__(self, prober: Prober, nodes: list[NodeConfig]):
        self.found: set[str] = set()
        self.done = threading.Event()
        threading.Thread(target=self._ask, args=(prober, nodes), name="rejoin", daemon=True).start()

    def _ask(self, prober: Prober, nodes: list[NodeConfig]) -> None:
        try:
            self.found = answering(prober, nodes)
        finally:
            self.done.set()


class Streaks:
    """Since when each asked node has answered without a miss; which have for ``rejoin_after``.
    Pure: the tests drive it with their own clock."""

    def __init__(self, rejoin_after: float):
        self.rejoin_after = rejoin_after
        self.since: dict[str, float] = {}

    def heard(self, now: float, asked: list[str], answered: set[str]) -> set[str]:
        """After one ask at ``now``: the nodes healthy for long enough (a miss starts a node over)."""
        for label in asked:
            if label in answered:
                self.since.setdefault(label, now)
            else:
                self.since.pop(label, None)
        return {label for label, since in self.since.items() if now - since >= self.rejoin_after}


ASK_AT_ONCE = 8  # asks of a watch under way at once: below ssh.max_parallel's default (10) start slots
MISSED_MOST = 60.0  # the most seconds between two asks of a node that has not answered (each miss doubles it)


class Watch:
    """The nodes that could join (``candidates()``: the away nodes first, then those a
    `nodes_command:` lists for the first time), each asked on a clock of its own on a thread of its
    own: every ask_every(rejoin_after) seconds while it answers, less often after each miss (a dead
    host never holds up a live one, nor fills the ssh start slots: at most ASK_AT_ONCE at once).
    Once some have answered for rejoin_after, ``ready`` is called once with their labels, and the
    watch ends. ``close`` ends it sooner (the attempt ended first) and cuts the asks under way;
    ``join`` waits for the watch's own thread, bounded."""

    def __init__(self, prober: Prober, candidates: Callable[[], list[NodeConfig]], rejoin_after: float,
                 ready: Callable[[set[str]], None], clock: Callable[[], float] = time.monotonic,
                 every: float | None = None):
        self.closed = threading.Event()
        self.prober, self.clock = prober, clock
        self.every = ask_every(rejoin_after) if every is None else every
        self.streaks = Streaks(rejoin_after)
        self.lock = threading.Lock()
        self.due: dict[str, float] = {}  # when each node is asked next
        self.misses: dict[str, int] = {}  # its asks in a row that found it silent
        self.asking: set[str] = set()
        self.healthy: set[str] = set()
        self.woken = threading.Event()  # an ask ended: its node may be healthy now
        self.thread = threading.Thread(target=self._watch, args=(candidates, ready), name="rejoin-watch", daemon=True)
        self.thread.start()

    def _watch(self, candidates: Callable[[], list[NodeConfig]], ready: Callable[[set[str]], None]) -> None:
        while not self.closed.is_set():
            try:
                nodes = candidates()
            except Exception:  # noqa: BLE001 - a node list that cannot be read now: none this round
                nodes = []
            with self.lock:
                healthy = set(self.healthy)
                for node in self._due(nodes) if not healthy else ():
                    self.asking.add(node.label)
                    threading.Thread(target=self._ask, args=(node,), name="rejoin", daemon=True).start()
            if healthy:
                if not self.closed.is_set():
                    ready(healthy)
                return
            self.woken.wait(min(self.every, 1.0))
            self.woken.clear()

    def _due(self, nodes: list[NodeConfig]) -> list[NodeConfig]:
        """The nodes to ask now (under the lock): due, not under way, within ASK_AT_ONCE."""
        now, chosen = self.clock(), []
        for node in sorted(nodes, key=lambda n: self.misses.get(n.label, 0)):  # those that answer first
            if len(self.asking) + len(chosen) >= ASK_AT_ONCE:
                break
            if node.label not in self.asking and self.due.get(node.label, now) <= now:
                chosen.append(node)
        return chosen

    def _ask(self, node: NodeConfig) -> None:
        answered = answering(self.prober, [node]) if not self.closed.is_set() else set()
        with self.lock:
            # its time once answered: an ask begun while the link was down, that the link's return
            # let through, does not count the time it was down as time it answered
            now = self.clock()
            self.healthy |= self.streaks.heard(now, [node.label], answered)
            self.misses[node.label] = 0 if answered else self.misses.get(node.label, 0) + 1
            self.due[node.label] = now + min(MISSED_MOST, self.every * 2 ** self.misses[node.label])
            self.asking.discard(node.label)
        self.woken.set()

    def close(self) -> None:
        """No more asks; those under way are cut short (the attempt they were for ended)."""
        self.closed.set()
        self.woken.set()
        cut(self.prober)

    def join(self) -> None:
        self.close()
        self.thread.join(5.0)
