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
        sup.peers.send_all(wire.Heartbeat())
        peers = [n for n in sup.members.nodes if n != sup.spec.node]  # the master's need not be node 0
        lost = decide.lost_peers(now, peers, sup.peers.heard, sup.states, sup.spec.orphan_timeout)
        # every other node silent at once, most likely our own link cut: the first found lost, the
        # others silent for half of orphan_timeout at least (two heartbeats missed), not yet all past it
        quiet = decide.lost_peers(now, peers, sup.peers.heard, sup.states, sup.spec.orphan_timeout / 2)
        alone = len(peers) > 1 and bool(lost) and len(quiet) == len(peers)
        for node, silent in lost:
            sup.report(node, "lost", None, "no word from its agent for %.0f s" % silent + (
                "; every other node fell silent at once: this master node (node %d) is likely the one cut off"
                % sup.spec.node if alone else ""))
        self.watch_hang(now)
        why = self.reshape(now)
        if why is not None:
            sup.halt(why)

    def reshape(self, now):
        """An elastic job's change of nodes due now (members.py), decided under the lock the nodes'
        own threads link and unlink under: why the job stops for it (every node with its grace; the
        next attempt runs on the new nodes: decide.next_attempt's "grow" or "aside"), or None. Away
        nodes that have answered for rejoin_after first; else a node that has straggled for evict_after."""
        sup = self.sup
        with sup.lock:
            if sup.halted is not None:
                return None
            due = sup.members.due(now)
            if due:
                sup.members.reshape, sup.members.growing = "grow", due
                return "stopped to take node(s) %s back (answering for %.0f s)" % (
                    ", ".join(map(str, due)), now - min(sup.members.answering[n] for n in due))
            aside = sup.members.aside_due(now, sup.spec.node)
            if aside is None:
                return None
            late = {f.node: f for f in sup.late.figures()}[aside]
            sup.members.set_aside(aside)
        go = sup.runner.first_go  # the master node's Go: what ddp-up's preflight heard of every node's GPUs
        said = ((go.gpus_said if go is not None else None) or {}).get(str(aside), "no GPU facts")
        return "stopped to set node %d aside: it has straggled for %.0f s (%s); its GPUs at the preflight: %s" % (
            aside, sup.members.evict_after, late.how(), said)

    def watch_hang(self, now):
        sup = self.sup
        running = [n for n in sup.members.nodes if sup.states.get(n, {}).get("state") == "running"]
        own = {sup.spec.node: (now - sup.runner.out.last_output, now, sup.runner.waiting(), sup.runner.ranks_ended())}
        if sup.first_done is None and sup.progress.ended(running, own):
            sup.first_done = now  # a node whose ranks have all ended is done, as far as the others go
        quiet = sup.progress.quiet(running, now, sup.peers.heard, own)
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
