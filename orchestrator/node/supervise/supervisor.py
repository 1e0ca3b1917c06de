"""A detached job's agents watching each other: the Supervisor in the master node's agent, and
every other node's PeerLink to it (TCP on the master address; PEER frames, see wire.py). Each
connection first proves that it knows the job's token, at the supervisor's Door (door.py).
The decisions are decide.py's and members.py's; here is the I/O, with the clock injected.
"""

import socket
import threading
import time

from ..local.state import ATTEMPTS, ENDED, OUTCOME, write_record
from ..protocol import events, policy, wire
from ..protocol.stragglers import LateWatch
from . import decide, notify
from .door import JOIN_TIMEOUT, Door, proof
from .members import Members
from .watching import Watch

AWAY_WAIT_LEAST = 60.0  # an elastic job's node that lost its supervisor waits this long at least to hear it again


def away_wait(spec):
    """How long a node of an elastic job (`min_nodes:`) that lost its supervisor waits, its part
    stopped, to hear it again (and be taken back) before its agent gives up: rejoin_after (the
    default's 10 minutes with `never`), at least a minute. A node always hears it after a break
    of the network; a supervisor gone for good leaves its agents idle this long at most."""
    return max(AWAY_WAIT_LEAST, spec.rejoin_after if spec.rejoin_after is not None else 600.0)


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
        self.links = {}  # node -> (socket, its send lock)
        self.heard = {}  # node -> when it was last heard (monotonic)
        self.halted = None  # the reason every node was told to stop
        self.finished = threading.Event()  # every node has ended the current attempt
        self.progress = decide.NodesProgress()  # what every node last said of its ranks
        self.launched = clock()  # when the current attempt started: start-up's limit counts from here
        self.startup = policy.startup_limit(self.spec.startup_timeout, self.spec.hang_timeout)  # its own limit
        self.hung = None  # (why, when the stacks were asked for), once the job looks hung
        self.first_done = None  # when the first node's job ended well (the others should follow)
        self.attempt = runner.attempt
        self.attempts = []  # the ended attempts (the current one too, once a restart is decided), as outcome.json lists them
        self.restart_frame = None  # the current attempt's Restart, for a node that missed it
        self.late = LateWatch(self.spec.nodes)  # which node comes last to the collectives (stragglers.py)
        self.book = decide.RestartBook(self.spec, clock())  # the restarts made so far, and the next's words
        self.members, self.next_nodes = Members(self.spec), None  # each attempt's nodes (`min_nodes:`); the next's
        self.over_event = threading.Event()  # no attempt follows: the watch ends
        self.door = Door(listener, self.spec, self.serve)
        self.watcher = Watch(self)

    def start(self, watch=True):
        """Accept the other nodes; ``watch``: tick every heartbeat on a thread of its own (its
        tests call tick themselves, in fake time)."""
        now = self.launched = self.clock()
        self.book.started(now)
        self.heard = {node: now for node in range(self.spec.nodes)}  # joining is due from Go on
        write_record(self.runner.dir, {"attempts": []}, ATTEMPTS)  # an attach knows the master node by it
        self.door.open()
        if watch:
            threading.Thread(target=self.watch, name="supervisor-watch", daemon=True).start()

    def serve(self, conn, node, stream):
        """A node that joined (see Door): its reports until it closes; one that joins after the
        job was halted hears so at once."""
        with self.lock:
            self.links[node] = (conn, threading.Lock())
            self.heard[node] = self.clock()
            self.members.linked(node, self.heard[node])
            halted = self.halted if not self.members.away(node) else None
        try:
            conn.settimeout(self.spec.orphan_timeout)
            if node in self.members.out:  # lost twice: its agent need wait no longer
                self.send(node, wire.RunOver(reason=self.members.out_words(node)))
            if halted:
                self.send(node, wire.Halt(reason=halted))
            while True:
                frame = wire.read_frame(stream, wire.PEER)
                if frame is None:
                    return
                self.heard_from(node, frame)
        except (OSError, ValueError, wire.ProtocolError):
            pass  # a silent node is found lost by tick()
        finally:
            with self.lock:
                if self.links.get(node, (None,))[0] is conn:
                    del self.links[node]
                    self.members.unlinked(node)
            conn.close()

    def heard_from(self, node, frame):
        now = self.clock()
        if isinstance(frame, wire.Progress) and frame.node == node:  # before heard: a tick that sees it sees these
            self.progress.said[node] = (frame.quiet, now, frame.waiting, frame.ended is True)
        self.heard[node] = now
        if isinstance(frame, wire.NodeState) and frame.node == node and not self.members.away(node):
            if frame.attempt < self.attempt and self.restart_frame is not None:
                self.send(node, self.restart_frame)  # it reconnected after the word went out
            self.report(node, frame.state, frame.code, frame.reason, frame.attempt, frame.final, frame.failure)
        elif isinstance(frame, wire.Arrivals):
            self.arrived(node, frame)

    def arrived(self, node, frame):
        """When ``node``'s ranks reached their collectives (its own, or a peer's Arrivals): a node
        that has just become a straggler is told of, once, as ddp-up tells of one."""
        with self.lock:
            named = self.late.arrivals(node, frame.times, float)
            self.members.straggling(self.late.figures(), self.clock())
        for late in named:
            self.runner.notices.send("straggler", "job %s: node %d is a straggler: %s" % (
                self.spec.job, late.node, late.how()), node=late.node)

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
            self.halt("node %d %s" % (node, decide.describe_end(state, code, reason)))
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
        heard_from); the watch starts afresh. Its Restart frame, for the master node's own agent."""
        with self.lock:
            self.book.begin(self.clock())
            self.attempt = attempt
            self.states, self.halted, self.hung, self.first_done = {}, None, None, None
            self.progress = decide.NodesProgress()
            self.late = LateWatch(self.spec.nodes)
            now = self.launched = self.clock()
            self.heard = {node: now for node in range(self.spec.nodes)}
            on = self.members.words(self.next_nodes) if self.next_nodes is not None else ""
            if self.next_nodes is not None:
                self.members.begin(self.next_nodes, list(self.links), now)
            self.restart_frame = wire.Restart(attempt=attempt, port=port, nodes=self.next_nodes)
            self.finished.clear()
        for node in list(self.links):
            if not self.members.away(node):
                self.send(node, self.restart_frame)
        root = notify.root_text(self.attempts[-1]["root_cause"])
        self.runner.notices.send("restart", "job %s: attempt %d ended (%s); attempt %d starts%s" % (
            self.spec.job, attempt - 1, root or "no root cause", attempt, on), attempt=attempt, root_cause=root)
        return self.restart_frame

    def decided(self):
        """An attempt follows: the decision is written now, for an attach (replay.decided)."""
        with self.lock:
            self.attempts.append(dict(self.summary(), next=self.book.words, next_nodes=self.next_nodes,
                                      reshaped=self.members.reshape))
        write_record(self.runner.dir, {"attempts": list(self.attempts)}, ATTEMPTS)

    def over(self, reason):
        """No attempt follows: the outcome is recorded and every node told (in place of a restart
        decided on, where the job was stopped while it waited, or no port was free)."""
        last = dict(self.summary(), next=reason)
        earlier = [a for a in self.attempts if a["attempt"] != self.attempt]
        write_record(self.runner.dir, dict(last, job=self.spec.job, attempts=earlier + [last]), OUTCOME)
        for node in list(self.links):
            self.send(node, wire.RunOver(reason=reason))
        self.over_event.set()
        self.runner.notices.ended(last, reason)

    def summary(self):
        return decide.attempt_summary(self.attempt, self.states, self.hung, self.halted, self.wall())

    def halt(self, reason):
        """Every node still running stops, the master node's too; only the first reason counts."""
        with self.lock:
            if self.halted is not None:
                return
            self.halted = reason
        for other in list(self.links):
            if self.states.get(other, {}).get("state") not in ENDED and not self.members.away(other):
                self.send(other, wire.Halt(reason=reason))
        self.runner.events.put(events.Halt(self.attempt, reason))

    def watch(self):
        while not self.over_event.wait(self.spec.heartbeat):
            self.tick(self.clock())

    def tick(self, now):
        """Once a heartbeat (Watch.tick)."""
        self.watcher.tick(now)


class PeerLink:
    """Every other node's agent, in a detached job: its line to the master node's Supervisor. A
    Halt stops the job here; a supervisor unheard for orphan_timeout (the master node or the
    network between them gone) stops it too, as a silent controller would. It reconnects while
    it waits: a short break in the network is not a failure. In an elastic job the silence stops
    only this attempt here (the job may go on without this node, and take it back): the agent
    waits to hear the supervisor again for away_wait, then stops for good."""

    def __init__(self, runner, addr, port, clock=time.monotonic):
        self.runner = runner
        self.spec = runner.spec
        self.addr, self.port = addr, port
        self.clock = clock
        self.lock = threading.Lock()
        self.sock = None
        self.heard = clock()
        self.state = wire.NodeState(node=self.spec.node, state="running")
        self.done = threading.Event()
        self.cut = False  # an elastic job's: this silence has stopped the attempt here

    def start(self):
        threading.Thread(target=self.run, name="peer-link", daemon=True).start()
        threading.Thread(target=self.beat, name="peer-beat", daemon=True).start()

    def run(self):
        while not self.done.is_set():
            try:
                self.session()
            except (OSError, ValueError, wire.ProtocolError):
                pass
            if self.done.wait(1.0):
                return

    def session(self):
        conn = socket.create_connection((self.addr, self.port), timeout=JOIN_TIMEOUT)
        try:
            conn.settimeout(self.spec.orphan_timeout)
            stream = conn.makefile("rb")
            challenge = wire.read_frame(stream, wire.PEER)
            if not isinstance(challenge, wire.Challenge):
                return
            with self.lock:
                conn.sendall(wire.Join(node=self.spec.node, proof=proof(self.spec.token, challenge.nonce)).encode()
                             + self.state.encode())
                self.sock = conn
            while True:
                frame = wire.read_frame(stream, wire.PEER)
                if frame is None:
                    return
                self.heard = self.clock()
                event = events.from_supervisor(frame, self.runner.attempt)
                if event is not None:
                    self.runner.events.put(event)
        finally:
            with self.lock:
                self.sock = None
            conn.close()

    def send(self, frame):
        with self.lock:
            if self.sock is None:
                return False
            try:
                self.sock.sendall(frame.encode())
                return True
            except OSError:
                return False

    def beat(self):
        while not self.done.wait(self.spec.heartbeat):
            stop = self.tick(self.clock())
            if isinstance(stop, events.Halt):  # an elastic job's: this attempt only
                self.runner.events.put(stop)
            elif stop is not None:  # the one node given the targets besides the master's tells (plan.agent_spec)
                self.runner.notices.send("lost", "job %s: node %d lost its supervisor for good: %s; it stops its part" % (
                    self.spec.job, self.spec.node, stop.reason), node=self.spec.node)
                self.runner.events.put(stop)
                return

    def tick(self, now):
        """Once a heartbeat: say how quiet this node's ranks are; the Stop a silent supervisor
        becomes (in an elastic job, first the Halt of this attempt, then the Stop once it has
        waited away_wait), or None."""
        self.send(wire.Progress(node=self.spec.node, quiet=now - self.runner.out.last_output,
                                waiting=self.runner.waiting(), ended=self.runner.ranks_ended()))
        silent = policy.silence(now, self.heard, self.spec.orphan_timeout)
        self.cut = self.cut and silent is not None
        if silent is None:
            return None
        words = "no word from the master node's supervisor for %.0f s" % silent
        if self.spec.min_nodes is None or silent > self.spec.orphan_timeout + away_wait(self.spec):
            return events.Stop(words)
        if self.cut:
            return None
        self.cut = True
        return events.Halt(self.runner.attempt, words + "; its part stops, and it waits to be taken back")

    def report(self, state, code, reason, attempt=0, final=False, failure=None, keep=False):
        """This node's end of ``attempt``, to the supervisor (waiting a little for a connection, if
        it is between two); the link then closes, unless ``keep``: the supervisor's word on a next
        attempt is to come."""
        self.set_state(wire.NodeState(node=self.spec.node, state=state, code=code, reason=reason,
                                      attempt=attempt, final=final, failure=failure))
        if not keep:
            self.close()

    def rejoin(self, attempt):
        self.set_state(wire.NodeState(node=self.spec.node, state="running", attempt=attempt))

    def set_state(self, state):
        with self.lock:
            self.state = state
        deadline = self.clock() + 2 * self.spec.heartbeat
        while not self.send(state) and self.clock() < deadline:
            time.sleep(0.1)

    def close(self):
        self.done.set()
