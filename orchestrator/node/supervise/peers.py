"""The other nodes' agents as the master node's Supervisor hears them: each one's connection, once
it joined at the Door (door.py), when each was last heard, and a frame sent to one or to all. The
I/O of the supervisor's role; what the frames mean is the Supervisor's (supervisor.py).
"""

import threading

from ..protocol import wire


class Peers:
    """``lock``: the supervisor's, which its decisions hold too (a node links and unlinks under it);
    ``clock``: monotonic time, injected (its tests run in fake time)."""

    def __init__(self, lock, clock):
        self.lock, self.clock = lock, clock
        self.links = {}  # node -> (socket, its send lock)
        self.heard = {}  # node -> when it was last heard (monotonic)

    def expect(self, nodes, now):
        """An attempt begins: every node is due to be heard from now on."""
        self.heard = {node: now for node in range(nodes)}

    def link(self, node, conn, timeout):
        """(Under the lock.) ``node`` joined over ``conn``: heard now; a read or a send on it waits
        ``timeout`` at most (orphan_timeout: a node that silent is lost)."""
        conn.settimeout(timeout)
        self.links[node] = (conn, threading.Lock())
        self.heard[node] = self.clock()

    def unlink(self, node, conn):
        """(Under the lock.) ``conn`` closed; whether it was ``node``'s link still (not replaced
        by a newer one, of the node joining again)."""
        if self.links.get(node, (None,))[0] is conn:
            del self.links[node]
            return True
        return False

    def listen(self, node, stream, hear):
        """``node``'s frames until it closes, each to ``hear(node, frame, now)``, then heard now
        (a watch that sees it heard sees what it said); a silent node is found lost by the
        supervisor's watch, not here."""
        while True:
            frame = wire.read_frame(stream, wire.PEER)
            if frame is None:
                return
            now = self.clock()
            hear(node, frame, now)
            self.heard[node] = now

    def send(self, node, frame):
        link = self.links.get(node)
        if link is None:
            return
        conn, lock = link
        try:
            with lock:
                conn.sendall(frame.encode())
        except OSError:
            pass

    def send_all(self, frame, but=lambda node: False):
        """``frame`` to every node linked now, but those ``but`` names."""
        for node in list(self.links):
            if not but(node):
                self.send(node, frame)
