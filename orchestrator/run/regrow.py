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


class Watch:
    """The nodes that could join (``candidates()``: the away nodes, and those a `nodes_command:`
    lists for the first time) asked every ask_every(rejoin_after) seconds on a thread of its own,
    until some have answered for rejoin_after: ``ready`` is called once with their labels, and the
    watch ends. ``close`` ends it sooner (the attempt ended first); ``join`` waits for an ask
    under way (its ssh connections), bounded."""

    def __init__(self, prober: Prober, candidates: Callable[[], list[NodeConfig]], rejoin_after: float,
                 ready: Callable[[set[str]], None], clock: Callable[[], float] = time.monotonic,
                 every: float | None = None):
        self.closed = threading.Event()
        self.prober = prober
        self.every = ask_every(rejoin_after) if every is None else every
        self.most = 30.0  # an ask's own bound (a connect timeout and an agent's start), once one is under way
        self.thread = threading.Thread(target=self._watch, args=(prober, candidates, rejoin_after, ready, clock),
                                       name="rejoin-watch", daemon=True)
        self.thread.start()

    def _watch(self, prober: Prober, candidates: Callable[[], list[NodeConfig]], rejoin_after: float,
               ready: Callable[[set[str]], None], clock: Callable[[], float]) -> None:
        streaks = Streaks(rejoin_after)
        while not self.closed.wait(self.every):
            try:
                nodes = candidates()
            except Exception:  # noqa: BLE001 - a node list that cannot be read now: none this round
                nodes = []
            self.most = max([self.most] + [n.ssh.connect_timeout + 20.0 for n in nodes])
            healthy = streaks.heard(clock(), [n.label for n in nodes], answering(prober, nodes) if nodes else set())
            if healthy and not self.closed.is_set():
                ready(healthy)
                return

    def close(self) -> None:
        """No more asks; the one under way, if any, is cut short (the attempt it was for ended)."""
        self.closed.set()
        cut(self.prober)

    def join(self) -> None:
        self.close()
        self.thread.join(self.most)
