"""A detached job's journals, read from every node at once, put back in time order.

Each node replays its journal as fast as it can, so without this ``ddp-logs`` would show the
nodes one after the other. The journal stamps the node's wall clock every fraction of a second
(``wire.Stamp``); an event takes the time of the last stamp before it, and is held until no node
still replaying its backlog can send an earlier one (the watermark: the oldest of their latest
stamps). A node whose backlog has been sent (``Replayed``, its ``JournalEnd``) or whose channel
ended no longer holds the others back, nor does one the attach gave up on (``let_go``: never
reached, or silent); once every node is there, events pass straight through. A node whose end is
held here has ended all the same (``ended``): its silence from then on is no loss.

Order is per stamp, so it is as good as the nodes' clocks agree; events from one node keep their
order; a journal without stamps (an older agent's) keeps the node-by-node order.
"""

from __future__ import annotations

import heapq

from ..node.protocol import wire
from .events import Closed, Message, SetupFailed

BEFORE_ANY = float("-inf")
AFTER_ALL = float("inf")


class BacklogOrder:
    def __init__(self, nodes: int):
        self.at = [BEFORE_ANY] * nodes  # each node's latest stamp (AFTER_ALL once it is live)
        self.held: list[tuple[float, int, object]] = []  # a heap of (time, arrival, event)
        self.arrivals = 0
        self.ended: set[int] = set()  # the nodes whose journal's end or channel's end has arrived (held or not)

    @property
    def live(self) -> bool:
        return all(at == AFTER_ALL for at in self.at)

    def take(self, event: object) -> list:
        """``event`` as it arrived -> the events that may be handled now, in time order."""
        return [each for _, each in self.take_timed(event)]

    def take_timed(self, event: object) -> list:
        """As ``take``, each with when its node recorded it (its journal's last stamp before it;
        None for what is live, or came before any stamp): a replay's clock."""
        node = getattr(event, "node", None)
        frame = event.frame if isinstance(event, Message) else None
        if isinstance(frame, (wire.Stamp, wire.Replayed)):  # the order's own: nothing to handle
            if self.live or not isinstance(node, int) or not 0 <= node < len(self.at) or self.at[node] == AFTER_ALL:
                return []
            if isinstance(frame, wire.Replayed):
                self.at[node] = AFTER_ALL  # its backlog is all here: what it sends from now on is live
            elif isinstance(frame.at, (int, float)):
                self.at[node] = max(self.at[node], float(frame.at))
            return self._release()
        if self.live or not isinstance(node, int) or not 0 <= node < len(self.at):
            return [(None, event)]
        self.arrivals += 1
        heapq.heappush(self.held, (self.at[node], self.arrivals, event))
        if isinstance(frame, wire.JournalEnd) or isinstance(event, (Closed, SetupFailed)):
            self.at[node] = AFTER_ALL  # its backlog is all here: it holds no one back
            self.ended.add(node)
        return self._release()

    def let_go(self, node: int) -> list:
        """``node`` will send nothing more (the attach gave up on it): it holds no one back. The
        events that may be handled now, as take_timed's."""
        if self.live or not 0 <= node < len(self.at):
            return []
        self.at[node] = AFTER_ALL
        return self._release()

    def _release(self) -> list:
        watermark = min(self.at)
        out = []
        while self.held and self.held[0][0] <= watermark:
            at, _, event = heapq.heappop(self.held)
            out.append((at if BEFORE_ANY < at < AFTER_ALL else None, event))
        return out
