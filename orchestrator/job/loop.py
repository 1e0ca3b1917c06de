"""The job loop: open every node in parallel, start them together, watch, fail fast, clean up.

The main thread consumes one event queue (fed by the node sessions' threads and woken by the
signal handler) and owns every decision and every change to the job's state (the node states
and their transitions are documented at ``outcome.State``; nodetable.py makes them). What the
nodes say is read by reports.py, which returns asks (events.py) that this module applies; the
phases' values are phases.py's, the pace's pace.py's, the stop path is stoppath.py's; hang
detection (hang.py), the cross-node checks (preflight.py) and the sweeps of lost nodes
(cleanup.py) are units of their own that return decisions; this module acts on them. No other
module keeps a Job or writes into one (tests/unit/test_shape.py checks). Per-node outcomes are
values, and the first failure by time is named as the root cause.

Signals are events: the loop reads the inbox at every turn. The first asks every node to stop
(Stop, then Kill after stop_grace, then a sweep), the second kills at once; either at any phase.
"""

from __future__ import annotations

import queue
import signal
import threading
import time
from dataclasses import replace
from typing import Callable, Protocol

from ..diagnose.flight import FlightLog
from ..diagnose.outcome import Failure, FailureKind, JobResult, JobSnapshot, NodeStatus
from ..diagnose.progress import Bar
from ..errors import NodeProblem, SetupError
from ..node.protocol import wire
from ..plan.launch import LaunchPlan, NodePlan
from ..remote.cleanup import LostNodeSweeper, sweep_notices
from ..remote.parallel import on_each
from ..remote.signals import INBOX, SignalInbox
from ..remote.transports import forget_connection, transport_for
from . import phases
from .backlog import BacklogOrder
from .events import (WAKE, ChannelEnded, JournalRead, KilledBy, LogLine, Lost, MasterPort, Message, Record,
                     Reshape, SupervisorPort, Wake)
from .following import Following
from .hang import LINGERED, AskStacks, Finishing, HangWatch, Hung
from .nodetable import NodeTable
from .pace import PaceReports
from .reports import BY_DDP_KILL, NodeReports
from .session import NodeSession
from .stoppath import StopPath

TICK = 0.25  # the loop's longest sleep: views redraw and deadlines are checked at least this often


class View(Protocol):
    """(A view may also have ``kept_lines(node, lines)``: lines to keep but not show, the run logs'.)"""

    def lines(self, node: NodePlan, lines: list[LogLine]) -> None: ...
    def node_state(self, status: NodeStatus) -> None: ...
    def notice(self, text: str) -> None: ...
    def bars(self, node: NodePlan, bars: list[Bar], at: float | None = None) -> None:
        """What the node's ranks draw now (progress bars), each time it changes; ``at``: when
        the node recorded them (a detached job's replay), else now."""
    def gpus(self, node: NodePlan, gpus: list, at: float | None = None) -> None:
        """A sample of the node's GPUs (wire.GpuUsage's), for the run's timeline."""
    def late(self, figures) -> None:
        """Each node's lateness at the collectives now (stragglers.Lateness), for the run's timeline."""
    def event(self, kind: str, text: str, **fields) -> None:
        """Something happened that the user may want to hear of away from the screen (notify.py)."""
    def tick(self, snapshot: Callable[[], JobSnapshot]) -> None:
        """Called often from the job loop; a view that redraws builds the snapshot only when it does."""


class Session(Protocol):
    """What the job needs of a node session (NodeSession; fakes in the unit tests)."""

    last_heard: float
    heard: bool  # the agent said something (before that, its start: phases.first_word)
    started: bool

    def open(self) -> None: ...
    def send(self, frame: wire.Frame) -> None: ...
    def cancel(self) -> None: ...
    def close(self) -> None: ...
    def disconnect(self, wait: bool = True) -> None: ...


class Sweeper(Protocol):
    def start(self, node) -> None: ...
    def finish(self) -> list: ...


def real_sessions(plan: LaunchPlan, post: Callable[[object], None], clock: Callable[[], float]) -> list[Session]:
    return [NodeSession(plan, n, transport_for(n.config), post, clock) for n in plan.nodes]


def start_threads(sessions: list[Session]) -> None:
    """Connect every node at once. Daemon threads, not an executor: a connect stuck on a dead
    host must not delay exit."""
    for i, session in enumerate(sessions):
        threading.Thread(target=session.open, name=f"connect-{i}", daemon=True).start()


class JobLoop:
    """The job's state and the turning of its loop: one event at a time, then signals, deadlines
    and views. Every change to the job's own state is made here (the report handlers ask, by
    value: events.py); Job, below, takes the loop through a job's phases."""

    def __init__(self, plan: LaunchPlan, view: View, *, preflight: bool = True,
                 sessions: Callable[..., list[Session]] = real_sessions,
                 opener: Callable[[list[Session]], None] = start_threads,
                 sweeper: Sweeper | None = None, events: queue.SimpleQueue | None = None,
                 inbox: SignalInbox = INBOX, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, shown: frozenset[int] | None = None):
        self.plan, self.view, self.preflight, self.clock, self.wall = plan, view, preflight, clock, wall
        self.events = events if events is not None else queue.SimpleQueue()
        self.inbox = inbox
        self.sessions = sessions(plan, self.events.put, clock)
        self.opener = opener
        self.sweeper = sweeper or LostNodeSweeper(plan.job_id, plan.run_token, plan.stop_grace,
                                                  lambda node: transport_for(node, shared=False))
        self.table = NodeTable(plan, view, clock, wall)
        self.stop = StopPath(plan, self.sessions, self.table, view, self.sweeper, clock)
        self.hang = HangWatch(plan.hang_timeout, plan.job_id, plan.startup_timeout)
        self.flight = FlightLog(len(plan.nodes), plan.world_size)
        self.pace = PaceReports(plan, self.table, view, self.flight, self.hang, clock, shown)  # `shown`: the console's ranks
        self.reports = NodeReports(plan, self.table, view, self.stop, (self.hang, self.flight, self.pace), clock, wall)
        self.master_port = plan.master_port
        self.supervisor_port: int | None = None  # detach: the master node's supervisor
        self.interrupted: int | None = None  # the first signal's number
        self.signals_seen = 0  # how many of the inbox's signals this loop has acted on
        self.started, self._next_heartbeat = clock(), 0.0
        self.went: float | None = None  # wall clock of the Go, once it went
        self.detached = False  # detach: every node runs, and this loop let go of the job
        self.reshape: Reshape | None = None  # the job was stopped to change its nodes (events.Reshape)
        self.following: Following | None = None  # attached to a detached job: its journals, read (see follow)
        self.channel_ended: set[int] = set()  # nodes whose channel reported its end (Closed)
        self.status: list[NodeStatus] = self.table.status  # the same list: the table changes it
        self._apply = {MasterPort: self._master_port, SupervisorPort: lambda ask: setattr(self, "supervisor_port", ask.port),
                       Record: lambda ask: self.record(ask.failure),
                       ChannelEnded: lambda ask: self.channel_ended.add(ask.node), KilledBy: self._killed_by,
                       Lost: lambda ask: self.lost(ask.node, ask.what),
                       JournalRead: lambda ask: self.following.journal_read(ask.node, ask.frame,
                                                                            ask.node == self.plan.master.index),
                       Reshape: self._reshape}

    # --- one turn of the loop ---

    def turn(self, deadline: float | None) -> None:
        """At most one event, then signals, heartbeats, deadlines, views."""
        now = self.clock()
        wait = TICK if deadline is None else max(0.0, min(deadline - now, TICK))
        try:
            event = self.events.get(timeout=wait)
        except queue.Empty:
            event = None
        if event is not None and not isinstance(event, Wake):
            if self.following and isinstance(event, Message) and isinstance(event.frame, wire.Replayed):
                self.following.record(event.frame, event.node == self.plan.master.index)  # the header's start, master
                self.up_since(event.node, event.frame.started)
            self._handle(self.following.order.take_timed(event) if self.following else ((None, event),))
        while self.signals_seen < len(self.inbox.received):
            self.signals_seen += 1
            self._on_signal(self.inbox.received[self.signals_seen - 1])
        self.stop.pass_on(self.inbox.passed_on, self.following)
        self._watch()
        self.view.tick(self.snapshot)

    def _handle(self, timed) -> None:
        """Events, each with its recorded time (None: now), in the order they are to be handled."""
        for at, each in timed:
            self.pace.recorded = at  # a replayed frame's own time: bars thinned by it, not by the replay's speed
            for ask in self.reports.handle(each):
                self._apply[type(ask)](ask)

    def wait(self, deadline: float, pending: Callable[[], bool]) -> None:
        """Turn until nothing is ``pending`` or the deadline passes."""
        while pending() and self.clock() < deadline:
            self.turn(deadline)

    def _on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self.following:
            self.interrupted = signum
            self.view.notice(f"{name}: detached; job {self.plan.job_id} goes on running")
        elif self.interrupted is None:
            self.interrupted = signum
            self.view.notice(f"{name}: stopping all nodes (Ctrl-C again to kill now)")
            self.view.event("signal", f"job {self.plan.job_id}: {name}: stopping all nodes", signal=name)
            self.stop.request(f"interrupted ({name})")
        elif not self.stop.killing:
            self.view.notice("killing every job process now")
            self.stop.kill_all(self.clock())
        # later signals: the kill is under way; cleanup runs to its end

    def _watch(self) -> None:
        """The deadlines: heartbeats, a silent node, a hang, the stop path's next step."""
        now = self.clock()
        beat = now >= self._next_heartbeat and not self.following  # a journal reader does not listen
        if beat:
            self._next_heartbeat = now + self.plan.heartbeat
        for index, problem in phases.unreached(self.sessions, self.status, now):
            self.table.error(index, problem)
            if self.following:  # a journal that cannot be read holds no other node's back
                self._handle(self.following.order.let_go(index))
        if self.following and (held := phases.held_back(self.following, self.sessions, self.status, now)):
            self.view.notice(held)
        listening = phases.listened(self.sessions, self.status, self.following.said_all if self.following else ())
        for session, _ in listening if beat else ():
            session.send(wire.Heartbeat())
        for index, silent in phases.silent(listening, self.plan, now):
            self.lost(index, f"no heartbeat from the node for {silent:.0f} s (network or node down?)")
        decision = self.hang.check(now, self.status, self.stop.requested, self.flight.blamed)
        if isinstance(decision, AskStacks):
            self.view.notice(f"job looks hung: {decision.why}; asking every rank for its Python stack")
            self.view.event("hang", f"job {self.plan.job_id} looks hung: {decision.why}", why=decision.why)
            for node in decision.nodes:
                self.sessions[node].send(wire.Dump())
        elif isinstance(decision, Hung):
            self.fail(decision.node, decision.rank, None, decision.what, kind="hung")
        elif isinstance(decision, Finishing):
            self.view.notice(decision.what)
        self._reshape(self.pace.aside(now))  # a straggler for evict_after, if one is due
        if not self.following and not self.stop.requested and self.hang.lingering(now, self.status):
            self.stop.request(LINGERED)
        self.stop.escalate(now)

    # --- what the reports ask ---

    def _master_port(self, ask: MasterPort) -> None:
        if self.master_port is None:  # the first one reported is the job's
            self.master_port = ask.port

    def _killed_by(self, ask: KilledBy) -> None:
        """ddp-kill is stopping this node's job (its note with the signal, node/local/state.py): the run
        is over as for a SIGTERM to ddp-up, every node stopped with its grace and no restart."""
        if self.following or self.interrupted is not None:
            return
        self.interrupted = signal.SIGTERM
        self.view.notice(f"{self.table[ask.node].plan.label}: {BY_DDP_KILL}; stopping all nodes")
        self.stop.request(BY_DDP_KILL)

    def _reshape(self, ask: Reshape | None) -> None:
        """Every node stops with its grace (the ranks save) for the next attempt to start on the
        new set; not once it stops anyway (a failure, a signal: that end decides what follows)."""
        if ask is not None and not self.following and not self.stop.requested:
            self.reshape = ask
            self.view.notice(f"{ask.why}: stopping all nodes with their grace (stop_grace: {self.plan.stop_grace:g} s "
                             "to save), to start again without delay")
            self.stop.request(ask.end)

    # --- failures ---

    def lost(self, node: int, what: str) -> None:
        """A node's agent is out of reach: swept over a fresh connection, and a failure unless the
        job was stopping already because of a signal."""
        cancel = self.status[node].slurm_cancel  # Slurm ended the step: not a lost network
        self.table.set(node, "lost", reason=cancel or what)
        forget_connection(self.plan.nodes[node].config)  # a dead link's connection: never used again
        self.sessions[node].close()
        if self.following:  # only this view of the node is lost; the job there goes on under its supervisor
            self._handle(self.following.order.let_go(node))
            return
        self.sweeper.start(self.plan.nodes[node].config)
        if not self.stop.requested or self.interrupted is None:
            self.fail(node, None, None, cancel or what, kind="outside" if cancel else "lost")

    def fail(self, node: int, rank: int | None, code: int | None, what: str, kind: FailureKind = "own",
             at: float | None = None) -> None:
        self.record(self.table.failure(node, rank, code, what, at, kind))

    def record(self, failure: Failure) -> None:
        """A failure: the first one stops every node (fail fast)."""
        self.table.fail(failure)
        if self.following:
            self.stop.requested = True  # by the job's own supervisor, on the nodes
        else:  # the first stops every node; a node lost later still tells the others (StopPath.request)
            how = "stopped from outside" if failure.kind == "outside" else "failed"  # Slurm's, a shutdown
            if not self.stop.requested:
                self.view.notice(f"{failure.label} {how}: {failure.what}; stopping all nodes")
            self.stop.request(f"{failure.label} {how}", peer_lost=failure.kind == "lost")

    # --- what it is ---

    def result(self) -> JobResult:
        failures = tuple(self.table.failures)
        result = JobResult(self.plan, self.table.outcomes(), self.master_port, failures, self.interrupted,
                           self.clock() - self.started, collectives=self.flight.diagnosis(failures, self.plan.rank_node),
                           lateness=self.flight.figures(),
                           values={rank: v for status in self.status for rank, v in status.results.items()})
        return self.following.result(result) if self.following else result

    def snapshot(self) -> JobSnapshot:
        now, late = self.clock(), self.flight.marks()
        cells = self.pace.cells(now)
        rows = tuple(replace(row, late=late.get(row.index, ""), bar=cells[row.index][0], progress=cells[row.index][1],
                             slow=cells[row.index][2]) for row in self.table.rows(now))
        known = self.following and self.following.started is not None  # a detached job: its own start, master
        return JobSnapshot(self.plan.job_id, self.following.master if known and self.following.master else
                           f"{self.plan.master_addr}:{self.master_port or 'auto'}",
                           self.plan.world_size, self.wall() - self.following.started if known else now - self.started,
                           self.table.phase(self.stop.requested, bool(self.interrupted)), rows, now,
                           self.plan.attempt, self.plan.quarantined, self.pace.eta(now))


class Job(JobLoop):
    """One attempt of a job, phase by phase: connect and preflight every node, check them across,
    start them together, supervise to the end, settle (run); or follow a detached one (follow), or
    check the nodes and start nothing (check)."""

    def grow(self, labels: set[str]) -> None:  # from any thread (run/regrow.Watch)
        self.events.put(Reshape(f"{', '.join(sorted(labels))} answer(s) again", join=frozenset(labels)))

    def run(self) -> JobResult:
        """Connect + preflight everywhere, start everywhere at once, supervise to the end.
        SetupError (nothing started anywhere) if a node is not fit to run."""
        with self.inbox.waking(lambda: self.events.put(WAKE)):
            self.opener(self.sessions)
            problems = self.await_ready()
            if not problems and self.preflight and not self.stop.requested:
                problems = self.check_nodes()
            if problems and not self.stop.requested:
                raise SetupError(problems)
            if not self.stop.requested:
                self.go()
            self._drain()
            if not self.detached:
                self.settle()
        return self.result()

    def follow(self) -> JobResult:
        """Attach to a detached job: every node's journal from its start, then live, through the same
        events, states and views as a run this loop started. The job's own agents decide everything
        (node/supervise/detached.py), so nothing is sent to them; a signal detaches. Ends when every node's
        journal has ended (its JournalEnd, after the attempt's Exited), or cannot be read on."""
        self.following = self.reports.following = following = Following(order=BacklogOrder(len(self.plan.nodes)))
        self.hang.why = "replayed"  # keep the stacks ranks print: a hung job's journal has them
        with self.inbox.waking(lambda: self.events.put(WAKE)):
            self.opener(self.sessions)
            while self.interrupted is None and not all(
                    s.plan.index in following.journal_ended or s.state in ("lost", "error")
                    or (s.terminal and s.plan.index in self.channel_ended) for s in self.status):
                self.turn(None)
        hung = None if self.table.failures or self.interrupted else self.hang.name_stopped(self.status, self.flight.blamed)
        if hung is not None:
            self.fail(hung.node, hung.rank, None, hung.what, kind="hung")
        return self.result()

    def check(self) -> list[NodeProblem]:
        """Connect, preflight and probe every node, start nothing (ddp-check)."""
        with self.inbox.waking(lambda: self.events.put(WAKE)):
            self.opener(self.sessions)
            problems = self.await_ready()
            if self.master_port is not None and all(s.state == "ready" for s in self.status):
                problems += self.check_nodes()
        return problems

    def close(self, sweeps: bool = True) -> None:
        """Always called (finally): drop connections, then wait for the sweeps of lost nodes
        (unless ``sweeps`` is False: a restart goes on while they end; report_sweeps later).
        Not interruptible: cleanup runs to its end (every step of it is bounded). A detached
        job's agents go on: only this end of their streams closes, without waiting for theirs."""
        if self.detached:
            for session in self.sessions:
                session.close()
            return
        for session in self.sessions:
            session.cancel()
        on_each(list(zip(self.sessions, self.status)), lambda pair: pair[0].disconnect(wait=pair[1].state != "lost"),
                inbox=None, name="disconnect")  # a lost node's link says nothing more: its threads are not waited for
        if sweeps:
            self.report_sweeps()

    def report_sweeps(self, back: frozenset[str] = frozenset()) -> None:
        """Wait for the sweeps of lost nodes (each bounded) and say how each went (``back``: the
        nodes that ran a later attempt of the run)."""
        for text in sweep_notices(self.sweeper.finish(), self.plan.orphan_timeout, back):
            self.view.notice(text)

    # --- the phases (their values: phases.py) ---

    def await_ready(self) -> list[NodeProblem]:
        self.wait(phases.ready_deadline(self.plan, self.clock()), lambda: any(s.state == "connecting" for s in self.status))
        for index, problem in phases.overdue(self.status):
            self.table.error(index, problem)
        return self.table.problems()

    def check_nodes(self) -> list[NodeProblem]:
        """Across nodes: the same torch as the master, enough GPUs, a real TCP path to the master."""
        probe = phases.probe(self.plan, self.master_port)
        for session in self.sessions:
            session.send(probe)
        self.wait(self.clock() + phases.PROBE_WAIT,
                  lambda: any(s.reach is None for s in self.status) and not self.stop.requested)
        problems, notices = phases.cross_checks(self.plan, self.status, self.master_port)
        for text in notices:
            self.view.notice(text)
        return problems

    def up_since(self, node: int, started) -> None:
        """An attached node's `up`, from the wall-clock start its record gives (not the attach's)."""
        if isinstance(started, (int, float)) and not isinstance(started, bool) and 0 <= node < len(self.status):
            self.status[node].started_at = self.clock() - max(0.0, self.wall() - started)

    def go(self) -> None:
        frames = phases.go_frames(self.plan, self.status, self.master_port, self.supervisor_port)
        self.hang.started(self.clock())
        self.went = self.wall()  # the ranks start: how long the attempt ran counts from here (attempts.ran)
        for session, status, frame in zip(self.sessions, self.status, frames):
            session.send(frame)
            status.started_at = self.clock()
            self.table.set(status.plan.index, "starting")

    def _drain(self) -> None:
        while not self.table.ended:
            if self.plan.detach and not self.stop.requested and all(s.state == "running" for s in self.status):
                self.detached = True  # the job's own agents watch it from here (node/supervise/detached.py)
                return
            times = self.stop.deadlines() + [t for t in (self.hang.deadline, self.hang.linger_deadline) if t is not None]
            self.turn(min(times) if times else None)

    def settle(self) -> None:
        """Every node has ended: let each channel report its own end (phases.settling)."""
        waiting = phases.settling(self.sessions, self.status)
        self.wait(self.clock() + phases.SETTLE, lambda: any(i not in self.channel_ended for i in waiting))
