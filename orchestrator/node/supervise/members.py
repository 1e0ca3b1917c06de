"""An elastic detached job's nodes (`min_nodes:`), as its supervisor keeps them: the nodes the
current attempt runs on, and every other node of the cluster file's, away (lost, and not yet back)
or out for good (lost twice). An away node whose agent is linked to the supervisor again answers;
one that has answered for `rejoin_after:` is due back, and the job stops to take it (the attempt
after a restart that happens anyway takes every node that answers then). Pure: the supervisor
passes the time in; ``place`` lays out an attempt's ranks, the same on every node.

Without `min_nodes:` every attempt runs on every node, as before: a lost node ends the job.
"""

LOSSES_OUT = 2  # a node lost this many times is out for good, as in a run ddp-up watches


def place(sizes, nodes, node):
    """Where ``node`` stands in an attempt on ``nodes`` (indices; ``sizes``: each node's rank
    count, by index): (its node rank, its first global rank, the world size, the node count).
    Ranks follow the nodes' order in the cluster file, without gaps."""
    ordered = sorted(nodes)
    at = ordered.index(node)
    return at, sum(sizes[n] for n in ordered[:at]), sum(sizes[n] for n in ordered), len(ordered)


class Members:
    """The nodes of ``spec`` (a RunSpec: nodes, min_nodes, rejoin_after) and where each stands."""

    def __init__(self, spec):
        self.size = spec.nodes
        self.nodes = list(range(spec.nodes))  # the current attempt's
        self.min_nodes = spec.min_nodes  # None: not elastic
        self.rejoin_after = spec.rejoin_after  # None: never stop to take a node back
        self.answering = {}  # away node -> since when its agent has been linked without a break
        self.losses = {}  # node -> times lost
        self.out = set()  # lost LOSSES_OUT times: never taken back
        self.growing = []  # the away nodes the current attempt is being stopped to take back

    @property
    def elastic(self):
        return self.min_nodes is not None

    def away(self, node):
        return node not in self.nodes

    def linked(self, node, now):
        """``node``'s agent joined the supervisor: an away node answers from now."""
        if self.elastic and self.away(node) and node not in self.out:
            self.answering.setdefault(node, now)

    def unlinked(self, node):
        self.answering.pop(node, None)

    def lost(self, node):
        """``node`` was lost in the current attempt: it is away from the next (its agent may come
        back), out for good the second time."""
        self.losses[node] = self.losses.get(node, 0) + 1
        self.answering.pop(node, None)
        if self.losses[node] >= LOSSES_OUT:
            self.out.add(node)

    def out_words(self, node):
        return "node %d is out of the job for good (lost %d times)" % (node, self.losses[node])

    def after(self, states):
        """After an attempt whose nodes ended as ``states`` ({node: {"state"}}): (the next attempt's
        nodes, (why it cannot go on, whether it was stopped to grow): decide.next_attempt's
        ``elastic``), or (None, None) for a job that is not elastic."""
        if not self.elastic:
            return None, None
        nodes, short = self.following([n for n, st in states.items() if st["state"] == "lost"])
        return nodes, (short, bool(self.growing))

    def due(self, now):
        """The away nodes that have answered for rejoin_after, while the job runs smaller and is
        not already stopping to take one back: the job stops now to take them."""
        if not self.elastic or self.rejoin_after is None or self.growing:
            return []
        return sorted(n for n, since in self.answering.items() if now - since >= self.rejoin_after)

    def following(self, lost):
        """The next attempt's nodes: this attempt's that were not ``lost``, and every away node that
        answers now. (nodes, None), or (None, why not): fewer than min_nodes."""
        nodes = sorted({n for n in self.nodes if n not in lost} | set(self.answering))
        if len(nodes) < self.min_nodes:
            gone = sorted(set(range(self.size)) - set(nodes))
            return None, "%d of %d nodes left (node(s) %s away), fewer than min_nodes: %d" % (
                len(nodes), self.size, ", ".join(map(str, gone)), self.min_nodes)
        return nodes, None

    def begin(self, nodes, linked, now):
        """The next attempt runs on ``nodes``; a node left out whose agent is still ``linked``
        answers from now."""
        self.nodes, self.growing = list(nodes), []
        for node in nodes:
            self.answering.pop(node, None)
        for node in linked:
            self.linked(node, now)

    def words(self, nodes):
        """What the next attempt's words add: the nodes it runs on, where they are not every node."""
        if len(nodes) == self.size:
            return " on all %d nodes" % self.size if len(self.nodes) < self.size else ""
        return " on %d of %d nodes (node(s) %s away)" % (
            len(nodes), self.size, ", ".join(str(n) for n in range(self.size) if n not in nodes))
