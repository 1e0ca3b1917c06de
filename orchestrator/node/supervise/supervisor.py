"""A detached job's supervisor: the master node's agent, which every other node's agent joins
(peerlink.py; TCP on the master address, PEER frames, see wire.py), each connection proving first
that it knows the job's token at the Door (door.py). Its roles: its connections (peers.py), what it
hears on them (hearing.py), its watch once a heartbeat (watching.py), what it wrote down
(ledger.py), and here what the nodes' words decide: an attempt's end, a restart or the job's end.
The rules are decide.py's and members.py's; the clock is injected.
"""

import threading
import time

from ..local.state import ENDED
from ..protocol import events, policy, wire
from ..protocol.stragglers import LateWatch
from . import decide
from .door import Door
from .hearing import Hearing
from .ledger import Ledger
from .members import Members
from .peers import Peers
from .watching import Watch


class Supervisor:
    """The master node's agent, in a detached job: every other node's agent joins it and reports
    its state. Once every node has ended the attempt, either the job is over (its outcome is
    recorded here, every node told RunOver) or, with restarts left and every node still heard,
    the master node's agent waits the delay and calls restart (every node told Restart).
    ``clock``/``wall``: monotonic and wall time, injected so its tests run in fake time."""

    def __init__(self, runner, listener, clock=time.monotonic, wall=time.time):
        self.runner, self.spec, self.listener = runner, runner.spec, listener
        self.port = listener.getsockname()[1]
        self.clock, self.wall = clock, wall
        self.lock = threading.Lock()
        self.states = {}  # node -> {"state", "code", "reason", "at", "final"}, of the current attempt
        self.peers = Peers(self.lock, clock)  # the other nodes' connections, and when each was last heard
        self.halted = None  # the reason every node was told to stop
        self.finished = threading.Event()  # every node has ended the current attempt
        self.progress = decide.NodesProgress()  # what every node last said of its ranks
        self.launched = clock()  # when the current attempt started: start-up's limit counts from here
        self.startup = policy.startup_limit(self.spec.startup_timeout, self.spec.hang_timeout)  # its own limit
        self.hung = None  # (why, when the stacks were asked for), once the job looks hung
        self.first_done = None  # when the first node's job ended well (the others should follow)
        self.attempt = runner.attempt
        self.ledger = Ledger(runner)  # what it decided, written for an attach and the user
        self.restart_frame = None  # the current attempt's Restart, for a node that missed it
        self.late = LateWatch(self.spec.nodes)  # which node comes last to the collectives (stragglers.py)
        self.book = decide.RestartBook(self.spec, clock())  # the restarts made so far, and the next's words
        self.members, self.next_nodes = Members(self.spec), None  # each attempt's nodes (`min_nodes:`); the next's
        self.over_event = threading.Event()  # no attempt follows: the watch ends
        self.hearing, self.watcher = Hearing(self), Watch(self)  # its ears, and its watch once a heartbeat
        self.door = Door(listener, self.spec, self.hearing.serve)

    def start(self, watch=True):
        """Accept the other nodes; ``watch``: tick every heartbeat on a thread of its own (its
        tests call tick themselves, in fake time)."""
        now = self.launched = self.clock()
        self.book.started(now)
        self.peers.expect(self.spec.nodes, now)  # joining is due from Go on
        self.ledger.open()
        self.door.open()
        if watch:
            threading.Thread(target=self.watch, name="supervisor-watch", daemon=True).start()

    def send(self, node, frame):
        self.peers.send(node, frame)

    def arrived(self, node, frame):
        """When ``node``'s ranks reached their collectives (its own, or a peer's Arrivals): a node
        that has just become a straggler is told of, once, as ddp-up tells of one."""
        with self.lock:
            named = self.late.arrivals(node, frame.times, float)
            self.members.straggling(self.late.figures(), self.clock())
        for late in named:
            self.runner.notices.send("straggler", "job %s: node %d is a straggler: %s" % (
                self.spec.job, late.node, late.how()), node=late.node)

    def report(self, node, state, code=None, reason=None, attempt=None, final=False, failure=None):
        with self.lock:
            if attempt is not None and attempt != self.attempt or self.members.away(node):
                return  # a word about another attempt (one resent on reconnecting), or from a node left out
            if self.states.get(node, {}).get("state") in ENDED:
                return  # a node ends once
            self.states[node] = decide.node_end(state, code, reason, final, failure, self.wall())
            if state == "done" and self.first_done is None:
                self.first_done = self.clock()
            if state == "lost" and self.members.elastic:
                self.members.lost(node)
            ended = sum(1 for st in self.states.values() if st["state"] in ENDED) == len(self.members.nodes)
        if state in ("failed", "stopped", "lost"):
            self.halt("node %d %s" % (node, decide.describe_end(state, code, reason)), peer_lost=state == "lost")
        if ended:
            blocker = self.why_not_restart()
            if blocker is not None:
                self.over(blocker)
            else:
                self.decided()
            self.finished.set()  # else the master node's agent restarts the job (DetachedRun.restart_here)

    def why_not_restart(self):
        """Why no attempt follows the one every node has ended, or None (its budget and words are
        kept for restart): decide.next_attempt, the rule ddp-up's restarts follow."""
        with self.lock:  # the nodes' own threads link and unlink them
            self.next_nodes, elastic = self.members.after(self.states)
        budget, words = self.book.decide(self.states, self.summary()["root_cause"], self.attempt, self.clock(),
                                         elastic)
        if budget and self.next_nodes is not None:
            self.book.words += self.members.words(self.next_nodes)
        return None if budget else words

    def restart(self, attempt, port):
        """Attempt ``attempt`` begins: every node of it is told (and any that rejoins later, see
        Hearing.heard_from); the watch starts afresh. Its Restart frame, for the master node's own agent."""
        with self.lock:
            self.book.begin(self.clock())
            self.attempt = attempt
            self.states, self.halted, self.hung, self.first_done = {}, None, None, None
            self.progress = decide.NodesProgress()
            self.late = LateWatch(self.spec.nodes)
            now = self.launched = self.clock()
            self.peers.expect(self.spec.nodes, now)
            on = self.members.words(self.next_nodes) if self.next_nodes is not None else ""
            if self.next_nodes is not None:
                self.members.begin(self.next_nodes, list(self.peers.links), now)
            self.restart_frame = wire.Restart(attempt=attempt, port=port, nodes=self.next_nodes)
            self.finished.clear()
        self.peers.send_all(self.restart_frame, but=self.members.away)
        self.ledger.restarted(attempt, on)
        return self.restart_frame

    def decided(self):
        """An attempt follows: the decision is written now, for an attach (replay.decided)."""
        with self.lock:
            summary, reshaped = self.summary(), self.members.reshape
        self.ledger.decided(summary, next=self.book.words, next_nodes=self.next_nodes, reshaped=reshaped)

    def over(self, reason):
        """No attempt follows: the outcome is recorded and every node told (in place of a restart
        decided on, where the job was stopped while it waited, or no port was free)."""
        last = self.ledger.over(self.summary(), reason)
        self.peers.send_all(wire.RunOver(reason=reason))
        self.over_event.set()
        self.runner.notices.ended(last, reason)

    def summary(self):
        return decide.attempt_summary(self.attempt, self.states, self.hung, self.halted, self.wall())

    def halt(self, reason, peer_lost=False):
        """Every node still running stops, the master node's too; only the first reason counts
        (``peer_lost``: for a node lost, see wire.Halt)."""
        with self.lock:
            if self.halted is not None:
                return
            self.halted = reason
        self.peers.send_all(wire.Halt(reason=reason, peer_lost=peer_lost),
                            but=lambda node: self.states.get(node, {}).get("state") in ENDED or self.members.away(node))
        self.runner.events.put(events.Halt(self.attempt, reason, peer_lost))

    def watch(self):
        while not self.over_event.wait(self.spec.heartbeat):
            self.tick(self.clock())

    def tick(self, now):
        """Once a heartbeat (Watch.tick)."""
        self.watcher.tick(now)
