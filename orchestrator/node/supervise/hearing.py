"""What the other nodes' agents say, as the master node's Supervisor hears it: a node that joined at
the Door (door.py) is served until it closes, and each of its frames is routed to the decision it
feeds (supervisor.py). The connections themselves are peers.py's; a node that falls silent is the
watch's to find (watching.py).
"""

from ..protocol import wire


class Hearing:
    """The Supervisor's ears: ``sup``'s lock, peers and members are shared with its decisions."""

    def __init__(self, sup):
        self.sup = sup

    def serve(self, conn, node, stream):
        """A node that joined (see Door): its reports until it closes; one that joins after the
        job was halted hears so at once."""
        sup = self.sup
        with sup.lock:
            sup.peers.link(node, conn, sup.spec.orphan_timeout)
            sup.members.linked(node, sup.peers.heard[node])
            halted = sup.halted if not sup.members.away(node) else None
        try:
            if node in sup.members.out:  # lost twice: its agent need wait no longer
                sup.send(node, wire.RunOver(reason=sup.members.out_words(node)))
            if halted:
                sup.send(node, wire.Halt(reason=halted))
            sup.peers.listen(node, stream, self.heard_from)
        except (OSError, ValueError, wire.ProtocolError):
            pass  # a silent node is found lost by the watch
        finally:
            with sup.lock:
                if sup.peers.unlink(node, conn):
                    sup.members.unlinked(node)
            conn.close()

    def heard_from(self, node, frame, now):
        """One frame from ``node`` (a frame naming another node is not its to say)."""
        sup = self.sup
        if isinstance(frame, wire.Progress) and frame.node == node:
            sup.progress.said[node] = (frame.quiet, now, frame.waiting, frame.ended is True)
        if isinstance(frame, wire.NodeState) and frame.node == node and not sup.members.away(node):
            if frame.attempt < sup.attempt and sup.restart_frame is not None:
                sup.send(node, sup.restart_frame)  # it reconnected after the word went out
            sup.report(node, frame.state, frame.code, frame.reason, frame.attempt, frame.final, frame.failure)
        elif isinstance(frame, wire.Arrivals):
            sup.arrived(node, frame)
