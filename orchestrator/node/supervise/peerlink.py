"""Every other node's agent, in a detached job: its line to the master node's Supervisor
(supervisor.py), joined at the supervisor's Door with the job's token (door.py).
"""

import socket
import threading
import time

from ..protocol import events, policy, wire
from .door import JOIN_TIMEOUT, proof

AWAY_WAIT_LEAST = 60.0  # an elastic job's node that lost its supervisor waits this long at least to hear it again


def away_wait(spec):
    """How long a node of an elastic job (`min_nodes:`) that lost its supervisor waits, its part
    stopped, to hear it again (and be taken back) before its agent gives up: rejoin_after (the
    default's 10 minutes with `never`), at least a minute. A node always hears it after a break
    of the network; a supervisor gone for good leaves its agents idle this long at most."""
    return max(AWAY_WAIT_LEAST, spec.rejoin_after if spec.rejoin_after is not None else 600.0)


class PeerLink:
    """Every other node's agent, in a detached job: its line to the master node's Supervisor. A
    Halt stops the job here; a supervisor unheard for orphan_timeout (the master node or the
    network between them gone) stops it too, as a silent controller would. It reconnects while
    it waits: a short break in the network is not a failure. In an elastic job the silence stops
    only this attempt here (the job may go on without this node, and take it back): the agent
    waits to hear the supervisor again for away_wait, then stops for good; at once where the master
    node answers again and refuses the connection (the supervisor's agent has ended: the job is over
    there, and no supervisor can come back on that port)."""

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
        self.refused = False  # the last try to reach the supervisor was refused: its agent has ended

    def start(self):
        threading.Thread(target=self.run, name="peer-link", daemon=True).start()
        threading.Thread(target=self.beat, name="peer-beat", daemon=True).start()

    def run(self):
        while not self.done.is_set():
            try:
                self.session()
            except ConnectionRefusedError:  # the master node answers, and nothing listens at the port
                self.refused = True
            except (OSError, ValueError, wire.ProtocolError):
                pass
            if self.done.wait(1.0):
                return

    def session(self):
        conn = socket.create_connection((self.addr, self.port), timeout=JOIN_TIMEOUT)
        self.refused = False
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
        if self.cut and self.refused:  # not a break in the network: nothing is left there to take it back
            return events.Stop(words + "; the master node answers again, but its supervisor has ended (the job "
                               "is over there)")
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
