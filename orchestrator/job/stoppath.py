"""The stop path of a job, once a stop is asked for (a failure, a signal, a hang): Stop to every
node, whose agent gives the job stop_grace; Kill to every node that has not confirmed by then
(STOP_MARGIN later); and, KILL_MARGIN after that, each node that still has not is declared lost
and swept over a fresh connection. A second signal kills at once. Every step is bounded.
"""

from __future__ import annotations

import signal
from typing import Callable

from ..node.protocol import wire
from ..plan.launch import LaunchPlan
from .nodetable import NodeTable

STOP_MARGIN = 5.0  # beyond stop_grace before a node that has not confirmed its stop is SIGKILLed (more than
# the agent's own margin, node/attempt/run.py's LAUNCHER_MARGIN: the agent ends it first, and says so)
REMIND = 10.0  # while nodes stop, how often the console says how many and how long is left
KILL_MARGIN = 5.0  # after SIGKILL before the node is declared lost and swept over a new channel


class StopPath:
    def __init__(self, plan: LaunchPlan, sessions: list, table: NodeTable, view, sweeper,
                 clock: Callable[[], float]):
        self.plan = plan
        self.sessions = sessions
        self.table = table
        self.view = view
        self.sweeper = sweeper
        self.clock = clock
        self.requested = False
        self.reason: str | None = None  # the first stop's
        self.peer_lost = False  # the stop's nodes were told that a node was lost
        self.stop_deadline: float | None = None
        self.kill_deadline: float | None = None
        self.next_reminder: float | None = None
        self.passed_on = 0  # how many of the inbox's SIGUSR1/SIGUSR2 have been passed on

    def request(self, reason: str, peer_lost: bool = False) -> None:
        """Stop every node (once): a node still connecting is cancelled (nothing started there).
        ``peer_lost``: for a node lost, its ranks stuck in a collective with it are not waited for
        (wire.Stop); a node lost once the stop is under way is told to the others then."""
        if self.requested:
            if peer_lost and not self.peer_lost and not self.killing:
                self.peer_lost = True
                for session, status in zip(self.sessions, self.table):
                    if not status.terminal and status.state != "lost":
                        session.send(wire.Stop(peer_lost=True))
            return
        self.requested, self.peer_lost, self.reason = True, peer_lost, reason
        self.stop_deadline = self.clock() + self.plan.stop_grace + STOP_MARGIN
        self.next_reminder = self.clock() + REMIND
        for session, status in zip(self.sessions, self.table):
            if status.state == "connecting":
                session.cancel()
                self.table.set(status.plan.index, "stopped", reason="cancelled while connecting")
            elif not status.terminal:
                status.reason, status.stop_asked = reason, self.clock()
                session.send(wire.Stop(peer_lost=peer_lost))

    def pass_on(self, got: list[int], following) -> None:
        """Each SIGUSR1/SIGUSR2 ddp-up got since the last turn (``got``: the inbox's, all of them):
        to every rank of every running node, straight; not a stop. (Attached to a detached job,
        ddp-up sends its agents nothing: ddp-kill --signal does that.)"""
        while self.passed_on < len(got):
            self.passed_on += 1
            self._pass_on(signal.Signals(got[self.passed_on - 1]).name, following)

    def _pass_on(self, name: str, following) -> None:
        if following:
            self.view.notice(f"{name}: not passed on (attached: ddp-kill --signal {name[3:]} --job "
                             f"{self.plan.job_id} sends it to every rank)")
            return
        running = [session for session, status in zip(self.sessions, self.table) if status.state == "running"]
        for session in running:
            session.send(wire.Signal(name=name))
        self.view.notice(f"{name}: passed on to every rank of {len(running)} running node(s)")

    def kill_all(self, now: float) -> None:
        """SIGKILL every job process still running; nodes that do not confirm in time are swept."""
        self.request("kill requested")
        self.kill_deadline = now + KILL_MARGIN
        for session, status in zip(self.sessions, self.table):
            if not status.terminal:
                session.send(wire.Kill())

    @property
    def killing(self) -> bool:
        return self.kill_deadline is not None

    def remind(self, now: float) -> None:
        """Every REMIND seconds of a graceful stop: how many nodes are still stopping (their
        ranks saving their work), how much of stop_grace is left, and how to cut it short."""
        if self.next_reminder is None or now < self.next_reminder or self.killing:
            return
        self.next_reminder = now + REMIND
        left = [s for s in self.table if not s.terminal]
        if left:
            grace = max(0.0, self.stop_deadline - STOP_MARGIN - now)
            self.view.notice(f"stopping: {len(left)} node(s) still running their ranks' stop, {grace:.0f} s of "
                             "stop_grace left; Ctrl-C again kills them now")

    def escalate(self, now: float) -> None:
        """The next step for the nodes that have not confirmed, once its deadline has passed."""
        self.remind(now)
        if self.stop_deadline is not None and now >= self.stop_deadline and self.kill_deadline is None:
            for status in self.table:
                if not status.terminal:
                    self.view.notice(f"{status.plan.label}: no stop confirmation; sending SIGKILL")
            self.kill_all(now)
        if self.kill_deadline is not None and now >= self.kill_deadline:
            for status in self.table:
                if not status.terminal:
                    self.table.set(status.plan.index, "lost", reason="did not confirm the stop; sweeping it")
                    self.sessions[status.plan.index].close()
                    self.sweeper.start(status.plan.config)

    def deadlines(self) -> list[float]:
        return [t for t in (self.stop_deadline, self.kill_deadline, self.next_reminder) if t is not None]
