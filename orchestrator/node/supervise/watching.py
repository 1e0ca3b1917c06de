"""A detached job's supervisor, once a heartbeat: a beat to every node, the silent ones found
lost, an elastic job's away nodes taken back once due (members.py), and the hang watch: every
node's ranks quiet past hang_timeout (or never begun past the start-up limit) are asked for their
stacks, then the job is halted (decide.hang_step decides each step).
"""

from ..protocol import events, wire
from . import decide


class Watch:
    """The watch of ``sup`` (a Supervisor: its nodes' states, links and progress)."""

    def __init__(self, sup):
        self.sup = sup

    def tick(self, now):
        """Once a heartbeat: beat to every node, find the silent ones lost, watch for a hang."""
        sup = self.sup
        for node in list(sup.links):
            sup.send(node, wire.Heartbeat())
        peers = [n for n in sup.members.nodes if n != sup.spec.node]  # the master's need not be node 0
        for node, silent in decide.lost_peers(now, peers, sup.heard, sup.states, sup.spec.orphan_timeout):
            sup.report(node, "lost", None, "no word from its agent for %.0f s" % silent)
        self.watch_hang(now)
        with sup.lock:  # the nodes' own threads link and unlink them
            due = sup.members.due(now)  # an elastic job's away nodes, back for rejoin_after
            since = min((sup.members.answering[n] for n in due), default=now)
            if due and sup.halted is None:
                sup.members.growing = due
        if due and sup.members.growing == due:
            self.grow(due, now - since)

    def grow(self, nodes, answered):
        """Away ``nodes`` have answered for rejoin_after: every node stops, with its grace, and the
        next attempt takes them back (decide.next_attempt's "grow")."""
        self.sup.halt("stopped to take node(s) %s back (answering for %.0f s)" % (", ".join(map(str, nodes)), answered))

    def watch_hang(self, now):
        sup = self.sup
        running = [n for n in sup.members.nodes if sup.states.get(n, {}).get("state") == "running"]
        own = {sup.spec.node: (now - sup.runner.out.last_output, now, sup.runner.waiting(), sup.runner.ranks_ended())}
        if sup.first_done is None and sup.progress.ended(running, own):
            sup.first_done = now  # a node whose ranks have all ended is done, as far as the others go
        quiet = sup.progress.quiet(running, now, sup.heard, own)
        step = decide.hang_step(now, sup.spec.hang_timeout, sup.hung, sup.halted, quiet, sup.first_done,
                                startup=sup.startup, late=sup.progress.late(running, own),
                                since_launch=now - sup.launched)
        if step is None:
            return
        what, why = step
        if what == "halt":
            sup.halt(why)
            return
        sup.hung = (why, now)
        sup.runner.notices.send("hang", "job %s looks hung: %s" % (sup.spec.job, why), why=why)
        for node in quiet:
            if node == sup.spec.node:
                sup.runner.events.put(events.Dump())
            else:
                sup.send(node, wire.DumpStacks())
