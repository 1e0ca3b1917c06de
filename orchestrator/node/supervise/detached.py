"""A detached job's run (``RunSpec.detach``): it goes on without the controller.

After Go, the job's record says it runs, its journal keeps every frame, and its agents watch each
other: the master node's agent is the job's supervisor, every other node's agent joins it (TCP,
each connection proving it knows the job's token). A closed controller connection or a SIGHUP (a
terminal closing) no longer stops the job.

The detached job's states, as its records show them (ddp-ls) and its supervisor drives them::

    running --every node ended, restart decided--> restarting --delay, Restart to every node--> running
       |                                               |
       +--every node ended, no restart--> done | failed | stopped      (outcome.json on the master)
                                                       ^
    restarting --a signal to the master's agent, ddp-kill--+
    running/restarting, agent gone without its record (SIGKILL, reboot) --> lost  (read, never written)

The first node to fail, stop or fall silent for orphan_timeout halts every node, as the controller
does for a job it watches; the decisions are decide.py's, pure.
"""

import os
import signal
import time

from ..attempt.run import Runner
from ..local.inventory import remove_stale_state
from ..local.state import BARS, JOURNAL, Journal, per_attempt, write_record
from .notify import JobNotices
from .restarts import Restarts, master_of
from .door import listen_for_peers
from .peerlink import PeerLink
from .supervisor import Supervisor


class DetachedRun(Runner):
    """The run with the detached job's hooks: its supervisor or link, journal, record, restarts."""
    warm_before_ready = True  # every node's ranks start together (run.await_warm)

    def __init__(self, spec, writer, clock=time.monotonic):
        Runner.__init__(self, spec, writer, clock)
        self.supervisor = None  # the master node: the Supervisor the other nodes join
        self.link = None  # the other nodes: their PeerLink to it
        self.record = None  # this node's record (see write_record), once the job runs on its own
        self.first_go = None  # attempt 0's Go, whose launch line every later attempt reuses
        self.next_go = None  # the Restart of the attempt to start next, between two attempts
        self.draft = None  # the record, written before the job starts; self.record once it runs on its own
        self.notices = JobNotices(spec, writer)  # the user's webhook and command targets (node/supervise/notify.py)
        self.restarts = Restarts(self)  # between two attempts
        self.ranks = list(spec.ranks or [0, 0])  # [first global rank, count] in this attempt (an elastic job's move)

    def prepare(self):
        if not (self.spec.check_port or self.spec.pick_port):
            return None  # not the master node: this node's agent joins the supervisor at Go
        self.supervisor = Supervisor(self, listen_for_peers(self.spec.master_addr))
        return self.supervisor.port

    def check_go(self, go):
        if not (self.supervisor or go.supervisor):
            return "protocol error from the controller: a detached Go without its supervisor"
        return None

    def before_start(self, go):
        self.out.secrets = tuple(sorted(self.spec.secrets or (), key=len, reverse=True))
        self.out.begun, self.out.first_rank = set(), self.ranks[0]  # this attempt's start-up
        if self.out.journal is not None:
            self.out.journal.close()  # the attempt before's is complete
        self.out.journal = Journal(os.path.join(self.dir, per_attempt(JOURNAL, self.attempt)),
                                   os.path.join(self.dir, per_attempt(BARS, self.attempt)))
        if self.draft is None:  # written before Started goes out: once ddp-up says the job runs, ddp-attach finds it
            self.draft = self.new_record(go)
            write_record(self.dir, self.draft)

    def new_record(self, go):
        return {"job": self.spec.job, "node": self.spec.node, "label": self.spec.label, "script": self.spec.script,
                "ranks": self.ranks, "pid": os.getpid(), "started": time.time(), "ended": None,
                "state": "running", "code": None, "reason": None, "retention": self.spec.retention,
                "attempt": self.attempt, "master": master_of(go.argv), "commit": self.spec.commit}

    def waiting(self):
        """This node's ranks (global) that have not begun: the supervisor's start-up watch."""
        first, count = self.ranks
        return [first + rank for rank in range(count) if rank not in (self.out.begun or ())]

    def ranks_ended(self):
        """Every rank here has ended while the launcher finishes: its silence is no hang."""
        ends = self.launch.rank_ends if self.launch is not None else None
        return ends is not None and ends.all_ended()

    def on_its_own(self):
        return self.record is not None

    def controller_gone(self, event):
        if not self.on_its_own():
            return Runner.controller_gone(self, event)
        self.out.broken = True  # the point of detaching
        return None

    def controller_silent(self, silent):
        if not self.on_its_own():
            return Runner.controller_silent(self, silent)
        self.out.broken = True  # a partitioned controller: its stream would block, the journal has it all
        return None

    def keeps_logs(self):
        return True

    def arrived(self, frame):
        """This node's Arrivals, to the supervisor's straggler watch (the master node's own, or over
        the link: never blocking the writer long, as PeerLink.send takes a lock, not a wait)."""
        if self.supervisor is not None:
            self.supervisor.arrived(self.spec.node, frame)
        elif self.link is not None:
            self.link.send(frame)

    def stop(self, reason, force, by=None, peer_lost=False):
        if by == "signal":  # anyone's but ddp-kill's (ddp-up, attached, sends this event itself)
            self.signalled(reason)
        return Runner.stop(self, reason, force, by, peer_lost)

    def signalled(self, reason):
        self.notices.send("signal", "job %s: %s (node %d) %s: its part stops, and with it the job" % (
            self.spec.job, self.spec.label, self.spec.node, reason), signal=reason.rpartition(" ")[2],
            node=self.spec.node, host=self.spec.label)

    def run_job(self, go):
        self.start(go)
        self.detach(go)
        while True:
            code = self.supervise()
            if self.next_go is None:
                self.notices.deliveries.wait()  # bounded: a target's send never holds the node past it
                return code
            self.restarts.begin(self.next_go)

    def detach(self, go):
        """From now on the job needs no controller."""
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        self.out.peers = self.arrived
        self.out.last_output = self.clock()  # the hang watch counts from the start, as ddp-up's does
        self.first_go = go
        self.record = self.draft
        try:
            remove_stale_state({}, records_only=True)  # finished detached jobs past their retention, here
        except OSError:
            pass  # housekeeping: nothing in another job's state may keep this one from being supervised
        if self.supervisor is not None:
            self.supervisor.start()
            self.supervisor.report(self.spec.node, "running")
        else:
            addr, port = go.supervisor
            self.link = PeerLink(self, addr, int(port))
            self.link.start()

    def after_exit(self, code, stopped, reason, failures, ends):
        """Recorded, told, and the next attempt decided or awaited (Restarts.after_exit)."""
        self.next_go = self.restarts.after_exit(code, stopped, reason, failures, ends)
        return self.next_go is not None


def run_mode(spec, writer):
    """Run mode: the job detached (a DetachedRun) or with the controller watching (a Runner)."""
    return (DetachedRun if spec.detach else Runner)(spec, writer).run()
