"""An elastic detached job's nodes (`min_nodes:`), as its supervisor keeps them: the nodes the
current attempt runs on, and every other node of the cluster file's, away (lost or set aside, and
not yet back) or out for good (lost or set aside twice). An away node whose agent is linked to the
supervisor again answers; one that has answered for `rejoin_after:` is due back, and the job stops
to take it (the attempt after a restart that happens anyway takes every node that answers then).
With `evict_after:`, a node named a straggler that long without a pause is due to be set aside,
where the nodes left are at least min_nodes: the job stops, and goes on without it. Pure: the
supervisor passes the time in; ``place`` lays out an attempt's ranks, the same on every node.

Without `min_nodes:` every attempt runs on every node, as before: a lost node ends the job.
"""

LOSSES_OUT = 2  # a node lost (or set aside) this many times is out for good, as in a run ddp-up watches
RESHAPES = {"grow": "stopped to take nodes back", "aside": "stopped to set a node aside"}  # decide.next_attempt's


def place(sizes, nodes, node):
    """Where ``node`` stands in an attempt on ``nodes`` (indices; ``sizes``: each node's rank
    count, by index): (its node rank, its first global rank, the world size, the node count).
    Ranks follow the nodes' order in the cluster file, without gaps."""
    ordered = sorted(nodes)
    at = ordered.index(node)
    return at, sum(sizes[n] for n in ordered[:at]), sum(sizes[n] for n in ordered), len(ordered)


class Members:
    """The nodes of ``spec`` (a RunSpec: nodes, min_nodes, rejoin_after, evict_after) and where each stands."""

    def __init__(self, spec):
        self.size = spec.nodes
        self.nodes = list(range(spec.nodes))  # the current attempt's
        self.min_nodes = spec.min_nodes  # None: not elastic
        self.rejoin_after = spec.rejoin_after  # None: never stop to take a node back
        self.evict_after = spec.evict_after  # None: a straggler is only named
        self.answering = {}  # away node -> since when its agent has been linked without a break
        self.losses = {}  # node -> times lost or set aside
        self.out = set()  # lost LOSSES_OUT times: never taken back
        self.late_since = {}  # node -> since when it has been named a straggler without a pause
        self.reshape = None  # how the current attempt is being stopped to change its nodes: "grow", "aside"
        self.growing = []  # the away nodes it is being stopped to take back
        self.aside = None  # or the node it is being stopped to set aside

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
        """``node`` was lost (or is set aside) in the current attempt: it is away from the next (its
        agent may come back), out for good the second time."""
        self.losses[node] = self.losses.get(node, 0) + 1
        self.answering.pop(node, None)
        if self.losses[node] >= LOSSES_OUT:
            self.out.add(node)

    def out_words(self, node):
        return "node %d is out of the job for good (lost or set aside %d times)" % (node, self.losses[node])

    def after(self, states):
        """After an attempt whose nodes ended as ``states`` ({node: {"state"}}): (the next attempt's
        nodes, (why it cannot go on, how it was stopped to change its nodes): decide.next_attempt's
        ``elastic``), or (None, None) for a job that is not elastic."""
        if not self.elastic:
            return None, None
        gone = [n for n, st in states.items() if st["state"] == "lost"] + ([self.aside] if self.aside is not None else [])
        nodes, short = self.following(gone)
        return nodes, (short, self.reshape)

    def due(self, now):
        """The away nodes that have answered for rejoin_after, while the job runs smaller and is
        not already stopping to take one back: the job stops now to take them."""
        if not self.elastic or self.rejoin_after is None or self.reshape:
            return []
        return sorted(n for n, since in self.answering.items() if now - since >= self.rejoin_after)

    def straggling(self, figures, now):
        """The straggler measure now (stragglers.Lateness of each node): since when each is named."""
        for figure in figures:
            if figure.straggler:
                self.late_since.setdefault(figure.node, now)
            else:
                self.late_since.pop(figure.node, None)

    def aside_due(self, now, master):
        """The node of this attempt (not ``master``'s: the supervisor is there) that has straggled for
        evict_after, where the run can do without it; None. At most one an attempt."""
        if self.evict_after is None or self.reshape or len(self.nodes) - 1 < (self.min_nodes or len(self.nodes)):
            return None
        return next((n for n, since in sorted(self.late_since.items())
                     if n in self.nodes and n != master and now - since >= self.evict_after), None)

    def set_aside(self, node):
        """``node`` is set aside: away from the next attempt, back as a lost node comes back (its agent,
        still linked, answers from the next attempt on); the second time, out for good."""
        self.reshape, self.aside = "aside", node
        self.lost(node)

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
        self.nodes, self.growing, self.aside, self.reshape, self.late_since = list(nodes), [], None, None, {}
        for node in nodes:
            self.answering.pop(node, None)
        for node in linked:
            self.linked(node, now)

    def words(self, nodes):
        """What the next attempt's words add: the nodes it runs on, where they are not every node."""
        if len(nodes) == self.size:
            return " on all %d nodes" % self.size if len(self.nodes) < self.size else ""
        missing = [n for n in range(self.size) if n not in nodes]
        away = [str(n) for n in missing if n not in self.out]
        out = [str(n) for n in missing if n in self.out]
        where = []
        if away:
            where.append("node(s) %s away" % ", ".join(away))
        if out:
            where.append("node(s) %s out for the rest of the job, lost or set aside %d times" % (", ".join(out), LOSSES_OUT))
        return " on %d of %d nodes (%s)" % (len(nodes), self.size, "; ".join(where))
