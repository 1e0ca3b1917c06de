"""The job loop: open every node in parallel, start them together, watch, fail fast, clean up.

The main thread consumes one event queue (fed by the node sessions' threads and woken by the
signal handler) and owns every decision and every state change (the states and their
transitions are documented at ``outcome.State``). Hang detection (hang.py), the cross-node
checks (preflight.py) and the sweeps of lost nodes (cleanup.py) are units of their own that
return decisions; this module acts on them. Per-node outcomes are values, and the first
failure by time is named as the root cause.

Signals are events: the loop reads the inbox at every turn. The first asks every node to stop
(Stop, then Kill after stop_grace, then a sweep), the second kills at once; either at any phase.
"""

from __future__ import annotations

import queue
import re
import signal
import threading
import time
from dataclasses import replace
from typing import Callable, Protocol

from . import preflight, wire
from .cleanup import LostNodeSweeper
from .errors import NodeProblem, SetupError
from .events import WAKE, Closed, Lines, LogLine, Message, SetupFailed, Wake
from .hang import AskStacks, HangWatch, Hung
from .outcome import Failure, JobResult, JobSnapshot, NodeStatus, State, TERMINAL
from .parallel import on_each
from .plan import LaunchPlan, NodePlan
from .session import NodeSession
from .signals import INBOX, SignalInbox
from .transport import transport_for

STOP_MARGIN = 5.0  # beyond stop_grace before a node that has not confirmed its stop is SIGKILLed
KILL_MARGIN = 5.0  # after SIGKILL before the node is declared lost and swept over a new channel
SETUP_MARGIN = 30.0  # beyond connect_timeout for an agent to preflight and report ready
PROBE_MARGIN = 10.0  # beyond the probe's own timeout for every node to answer it
LAST_LINE = 240  # characters of a node's latest line kept for the dashboard
SETTLE = 2.0  # after the last node's end, for the channels to report theirs (their last stderr lines)
TICK = 0.25  # the loop's longest sleep: views redraw and deadlines are checked at least this often


# slurmstepd's word when Slurm ends a step (scancel, the allocation's end, its time limit)
SLURM_CANCEL = re.compile(r"\*\*\* (STEP|JOB) (\S+) ON (\S+) CANCELLED AT \S+(?: DUE TO ([A-Z ]+?))? \*\*\*")


def slurm_cancel(text: str) -> str | None:
    """What a node's line says Slurm did to its step, if it says so."""
    m = SLURM_CANCEL.search(text)
    if m is None:
        return None
    why = f" due to {m.group(4).lower()}" if m.group(4) else " (scancel, or the allocation ended)"
    return f"Slurm cancelled {m.group(1).lower()} {m.group(2)}{why}"


class View(Protocol):
    def lines(self, node: NodePlan, lines: list[LogLine]) -> None: ...
    def node_state(self, status: NodeStatus) -> None: ...
    def notice(self, text: str) -> None: ...
    def tick(self, snapshot: Callable[[], JobSnapshot]) -> None:
        """Called often from the job loop; a view that redraws builds the snapshot only when it does."""


class Session(Protocol):
    """What the job needs of a node session (NodeSession; fakes in the unit tests)."""

    last_heard: float
    started: bool

    def open(self) -> None: ...
    def send(self, frame: wire.Frame) -> None: ...
    def cancel(self) -> None: ...
    def close(self) -> None: ...
    def disconnect(self) -> None: ...


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


class Job:
    def __init__(self, plan: LaunchPlan, view: View, *, preflight: bool = True,
                 sessions: Callable[..., list[Session]] = real_sessions,
                 opener: Callable[[list[Session]], None] = start_threads,
                 sweeper: Sweeper | None = None, events: queue.SimpleQueue | None = None,
                 inbox: SignalInbox = INBOX, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time):
        self.plan = plan
        self.view = view
        self.preflight = preflight
        self.clock = clock
        self.wall = wall
        self.events = events if events is not None else queue.SimpleQueue()
        self.inbox = inbox
        self.sessions = sessions(plan, self.events.put, clock)
        self.opener = opener
        self.sweeper = sweeper or LostNodeSweeper(plan.job_id, plan.run_token, plan.stop_grace,
                                                  lambda node: transport_for(node, shared=False))
        self.status = [NodeStatus(n) for n in plan.nodes]
        self.hang = HangWatch(plan.hang_timeout, plan.job_id)
        self.failures: list[Failure] = []
        self.master_port = plan.master_port
        self.interrupted: int | None = None  # the first signal's number
        self.signals_seen = 0  # how many of the inbox's signals this loop has acted on
        self.stop_requested = False
        self.stop_deadline: float | None = None
        self.kill_deadline: float | None = None
        self.started = clock()
        self._next_heartbeat = 0.0
        self.supervisor_port: int | None = None  # detach: the master node's supervisor
        self.detached = False  # detach: every node runs, and this loop let go of the job
        self.following = False  # attached to a detached job (see follow)
        self.journal_ended: set[int] = set()  # following: nodes whose journal was read to its end
        self.later_attempt = False  # following: a node's journal said a later attempt follows
        self.absent: set[int] = set()  # following: nodes where this attempt never began (the job ended first)
        self.channel_ended: set[int] = set()  # nodes whose channel reported its end (Closed)

    # --- entry points ---

    def run(self) -> JobResult:
        """Connect + preflight everywhere, start everywhere at once, supervise to the end.
        SetupError (nothing started anywhere) if a node is not fit to run."""
        with self.inbox.waking(lambda: self.events.put(WAKE)):
            self.opener(self.sessions)
            problems = self._await_ready()
            if not problems and self.preflight and not self.stop_requested:
                problems = self._check_nodes()
            if problems and not self.stop_requested:
                raise SetupError(problems)
            if not self.stop_requested:
                self._go()
            self._drain()
            if not self.detached:
                self._settle()
        return self.result()

    def follow(self) -> JobResult:
        """Attach to a detached job: every node's journal from its start, then live, through the
        same events, states and views as a run this loop started. The job's own agents decide
        everything (agent.Supervisor), so nothing is ever sent to them; a signal detaches. Ends
        when every node's journal has ended (or its node is unreachable)."""
        self.following = True
        self.hang.why = "replayed"  # keep the stacks ranks print: a hung job's journal has them
        with self.inbox.waking(lambda: self.events.put(WAKE)):
            self.opener(self.sessions)
            while self.interrupted is None and not all(self._followed(s) for s in self.status):
                self._turn(None)
        self._name_hung()
        return self.result()

    def _followed(self, status: NodeStatus) -> bool:
        """Following: this node's journal was read to its end (its JournalEnd, which says whether
        a later attempt follows, comes after the attempt's Exited), or it cannot be read on."""
        i = status.plan.index
        return i in self.journal_ended or status.state in ("lost", "error") or (
            status.terminal and i in self.channel_ended)

    def _journal_end(self, node: int, frame: wire.JournalEnd) -> None:
        status = self.status[node]
        self.journal_ended.add(node)
        self.later_attempt |= frame.later
        if frame.absent:
            self.absent.add(node)
        elif not frame.running and not status.terminal:
            self._set(node, "lost", reason="its journal ends before the job's end there (its agent was killed?)")

    def _name_hung(self) -> None:
        """A detached job its supervisor stopped as hung: the ranks to name, from the stacks that
        every node's journal holds (known only once all of them were read)."""
        why = next((s.reason for s in self.status if (s.reason or "").startswith("job hung")), None)
        if why is not None and not self.failures and self.interrupted is None:
            hung = self.hang.name_stopped(self.status, why)
            if hung is not None:
                self._fail(hung.node, hung.rank, None, hung.what)

    def check(self) -> list[NodeProblem]:
        """Connect, preflight and probe every node, start nothing (ddp-check)."""
        with self.inbox.waking(lambda: self.events.put(WAKE)):
            self.opener(self.sessions)
            problems = self._await_ready()
            if self.master_port is not None and all(s.state == "ready" for s in self.status):
                problems += self._check_nodes()
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
        on_each(self.sessions, lambda s: s.disconnect(), inbox=None, name="disconnect")
        if sweeps:
            self.report_sweeps()

    def report_sweeps(self) -> None:
        """Wait for the sweeps of lost nodes (each bounded) and say how each went."""
        for report in self.sweeper.finish():
            if report.error:
                self.view.notice(f"{report.node.label}: cleanup not confirmed ({report.error}); its agent stops the "
                                 f"job by itself within orphan_timeout ({self.plan.orphan_timeout:g} s), "
                                 f"or run ddp-kill")
            elif report.found:
                self.view.notice(f"{report.node.label}: swept {len(report.found)} leftover process(es)")

    def result(self) -> JobResult:
        return JobResult(self.plan, tuple(s.outcome() for s in self.status), self.master_port,
                         tuple(self.failures), self.interrupted, self.clock() - self.started)

    def snapshot(self) -> JobSnapshot:
        now = self.clock()
        return JobSnapshot(self.plan.job_id, f"{self.plan.master_addr}:{self.master_port or 'auto'}",
                           self.plan.world_size, now - self.started, self._phase(),
                           tuple(s.row(now) for s in self.status), now, self.plan.attempt, self.plan.quarantined)

    def _phase(self) -> str:
        if all(s.terminal for s in self.status):
            return "done" if all(s.state == "done" for s in self.status) else "failed"
        if self.stop_requested:
            return "failing" if self.failures and not self.interrupted else "stopping"
        if any(s.state in ("connecting", "ready") for s in self.status):
            return "connecting"
        return "running"

    # --- phase 1: connect and preflight ---

    def _await_ready(self) -> list[NodeProblem]:
        deadline = self.clock() + max(n.config.ssh.connect_timeout for n in self.plan.nodes) + SETUP_MARGIN
        while any(s.state == "connecting" for s in self.status):
            if self.clock() >= deadline:
                for s in self.status:
                    if s.state == "connecting":
                        self._error(s.plan.index, NodeProblem(s.plan.label, "no ready report from the node agent",
                                                              "check the node's load and filesystem"))
                break
            self._turn(deadline)
        return [s.problem for s in self.status if s.problem is not None]

    def _check_nodes(self) -> list[NodeProblem]:
        """Across nodes: the same torch as the master, enough GPUs, a real TCP path to the master."""
        probe = wire.Probe(addr=self.plan.master_addr, port=self.master_port, timeout=preflight.PROBE_TIMEOUT)
        for session in self.sessions:
            session.send(probe)
        deadline = self.clock() + preflight.PROBE_TIMEOUT + PROBE_MARGIN
        while any(s.reach is None for s in self.status) and self.clock() < deadline and not self.stop_requested:
            self._turn(deadline)
        busy, busy_notices = preflight.busy_gpus(self.status, self.plan.allow_busy_gpus)
        problems = preflight.cross_node_problems(self.status, self.plan.master.index,
                                                 f"{self.plan.master_addr}:{self.master_port}", busy)
        notices = preflight.skew_notices(self.status) + busy_notices
        for text in notices + ([] if problems else preflight.interface_notices(self.status)):
            self.view.notice(text)
        return problems

    # --- phase 2: go ---

    def _go(self) -> None:
        if self.master_port is None:
            raise SetupError([NodeProblem(self.plan.master.label, "the master did not report a free port")])
        if self.plan.detach and self.supervisor_port is None:
            raise SetupError([NodeProblem(self.plan.master.label, "the master did not report its supervisor's port",
                                          "use the same ddp-up version everywhere")])
        supervisor = [self.plan.master_addr, self.supervisor_port] if self.plan.detach else None
        self.hang.started(self.clock())
        for session, status in zip(self.sessions, self.status):
            session.send(wire.Go(argv=self.plan.launcher_argv(status.plan, self.master_port), supervisor=supervisor,
                                 env=preflight.interface_env(status) or None))
            status.started_at = self.clock()
            self._set(status.plan.index, "starting")

    # --- phase 3: supervise until every node is terminal ---

    def _drain(self) -> None:
        while not all(s.terminal for s in self.status):
            if self.plan.detach and not self.stop_requested and all(s.state == "running" for s in self.status):
                self.detached = True  # the job's own agents watch it from here (agent.Supervisor)
                return
            self._turn(self._soonest_deadline())

    def _settle(self) -> None:
        """Every node has ended: let each channel report its own end (within SETTLE), so what its
        stderr said last is read before the result, such as Slurm's word on a step it cancelled."""
        deadline = self.clock() + SETTLE
        waiting = [i for i, (s, st) in enumerate(zip(self.sessions, self.status))
                   if s.started and st.state in ("done", "failed", "stopped")]  # a lost node's, we closed
        while self.clock() < deadline and any(i not in self.channel_ended for i in waiting):
            self._turn(deadline)

    def _turn(self, deadline: float | None) -> None:
        """One turn of the loop: at most one event, then signals, heartbeats, deadlines, views."""
        now = self.clock()
        wait = TICK if deadline is None else max(0.0, min(deadline - now, TICK))
        try:
            event = self.events.get(timeout=wait)
        except queue.Empty:
            event = None
        if event is not None and not isinstance(event, Wake):
            self._handle(event)
        self._take_signals()
        self._heartbeat()
        self._watch()
        self.view.tick(self.snapshot)

    def _soonest_deadline(self) -> float | None:
        times = [t for t in (self.stop_deadline, self.kill_deadline, self.hang.deadline) if t is not None]
        return min(times) if times else None

    def _take_signals(self) -> None:
        while self.signals_seen < len(self.inbox.received):
            signum = self.inbox.received[self.signals_seen]
            self.signals_seen += 1
            self._on_signal(signum)

    def _on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self.following:
            self.interrupted = signum
            self.view.notice(f"{name}: detached; job {self.plan.job_id} goes on running")
            return
        if self.interrupted is None:
            self.interrupted = signum
            self.view.notice(f"{name}: stopping all nodes (Ctrl-C again to kill now)")
            self._request_stop(f"interrupted ({name})")
        elif self.kill_deadline is None:
            self.view.notice("killing every job process now")
            self._kill_all(self.clock())
        # later signals: the kill is under way; cleanup runs to its end

    def _heartbeat(self) -> None:
        now = self.clock()
        if now < self._next_heartbeat:
            return
        self._next_heartbeat = now + self.plan.heartbeat
        if self.following:
            return  # a journal reader does not listen
        for session, status in zip(self.sessions, self.status):
            if not status.terminal and session.started:
                session.send(wire.Heartbeat())

    # --- events ---

    def _handle(self, event: object) -> None:
        if isinstance(event, Closed):
            self.channel_ended.add(event.node)
        if isinstance(event, Lines):
            self._lines(event)
        elif self.following and isinstance(event, Message) and isinstance(event.frame, wire.JournalEnd):
            self._journal_end(event.node, event.frame)
        elif self.status[event.node].terminal or event.node in self.journal_ended:
            return  # e.g. a cancelled connect finishing late: its outcome is already decided
        elif isinstance(event, Message):
            self._message(event.node, event.frame)
        elif isinstance(event, Closed):
            self._closed(event)
        elif isinstance(event, SetupFailed):
            if self.status[event.node].state == "connecting" and not self.stop_requested:
                self._error(event.node, event.problem)
            else:
                self._set(event.node, "stopped", reason="cancelled while connecting")

    def _message(self, node: int, frame: wire.Frame) -> None:
        status = self.status[node]
        if isinstance(frame, wire.Ready) and status.state == "connecting":
            self._ready(node, frame)
        elif isinstance(frame, wire.Failed) and status.state == "connecting":
            self._error(node, NodeProblem(status.plan.label, frame.what, frame.fix))
        elif isinstance(frame, wire.Probed):
            status.reach = frame
        elif isinstance(frame, wire.Started):
            self._set(node, "running")
        elif isinstance(frame, wire.GpuUsage):
            status.gpus = frame.gpus
        elif isinstance(frame, wire.Dumped):
            self.hang.dumped(node, self.clock())
        elif isinstance(frame, wire.Stopping):
            self._set(node, "stopping", reason=frame.reason)
        elif isinstance(frame, wire.Exited):
            self._exited(node, frame)
        else:
            self._lost(node, f"protocol error from the node agent: unexpected {type(frame).__name__} "
                             f"while {status.state}")

    def _ready(self, node: int, frame: wire.Ready) -> None:
        status = self.status[node]
        status.info = frame.fields()
        known = self.plan.vetted.get(status.plan.label)
        if known and frame.torch is None:  # vetted in an earlier attempt: its agent did not probe torch again
            status.info.update(known)
        status.clock_skew = frame.time - self.wall()
        if frame.port is not None and self.master_port is None:
            self.master_port = frame.port
        if frame.supervisor_port is not None and node == self.plan.master.index:
            self.supervisor_port = frame.supervisor_port
        self._set(node, "ready")

    def _lines(self, event: Lines) -> None:
        status = self.status[event.node]
        for line in event.lines:
            if line.rank is None and line.stream != "node":
                status.report.feed(line.text)
            elif line.stream == "node" and status.slurm_cancel is None:
                status.slurm_cancel = slurm_cancel(line.text)
                if status.slurm_cancel is not None:
                    self._blame_slurm(event.node)
        self.hang.lines(event.lines, self.clock())
        status.lines += len(event.lines)
        status.last_line = event.lines[-1].text[:LAST_LINE]
        self.view.lines(status.plan, event.lines)

    def _blame_slurm(self, node: int) -> None:
        """Slurm's word comes on the step's stderr, which can arrive after the node's end (the agent
        stopped on Slurm's SIGTERM, or its srun ended): that end was Slurm's doing. So was a rank's
        death by a signal there: Slurm signals every process of the step, and a rank may die of
        it before its agent acts on its own."""
        status = self.status[node]
        self.failures = [replace(f, what=status.slurm_cancel)
                         if f.node == node and (f.rank is None or (f.exit_code or 0) < 0) else f
                         for f in self.failures]
        if status.state in ("stopped", "lost"):
            status.reason = status.slurm_cancel

    def _exited(self, node: int, frame: wire.Exited) -> None:
        status = self.status[node]
        status.exit_code, status.signal = frame.code, frame.signal
        if frame.gpu_left:
            self.view.notice(f"{status.plan.label}: {len(frame.gpu_left)} process(es) of this job still hold GPU "
                             f"memory after its end: {preflight.busy_gpu_text(frame.gpu_left)}")
        if self.stop_requested and (frame.stopped or frame.code != 0):
            self._set(node, "stopped", reason=status.reason or frame.reason)
        elif frame.stopped:
            self._set(node, "stopped", reason=status.slurm_cancel or frame.reason)
            if not self.following:  # a detached job's nodes stop when another fails: that one is the cause
                self._fail(node, None, frame.code, status.slurm_cancel or f"stopped on the node: {frame.reason}")
        elif frame.code == 0:
            self._set(node, "done")
            self.hang.node_done(self.clock())
        else:
            how = f"signal {frame.signal}" if frame.signal else f"code {frame.code}"
            self._set(node, "failed", reason=f"launcher exited with {how}")
            root = status.report.root
            rank = root.rank if root else None
            code = root.exit_code if root and root.exit_code is not None else frame.code
            what = f"rank {rank} exited with code {code}" if rank is not None else status.reason
            self._fail(node, rank, code, what, at=root.time if root else None)

    def _closed(self, event: Closed) -> None:
        status = self.status[event.node]
        if status.state == "connecting":
            self._error(event.node, event.end.problem(status.plan.config, "before it was ready"))
            return
        if event.end.protocol_error:
            what = f"protocol error from the node agent: {event.end.protocol_error}"
        else:
            tail = "; ".join(event.end.stderr_tail[-2:])
            what = "connection to the node agent lost" + (f" ({tail})" if tail else "")
        self._lost(event.node, what)

    # --- deadlines: silence, hangs, stop escalation ---

    def _watch(self) -> None:
        now = self.clock()
        for session, status in zip(self.sessions, self.status):
            silent = now - session.last_heard
            if status.terminal or status.plan.index in self.journal_ended:
                continue
            if session.started and silent > self.plan.orphan_timeout:
                self._lost(status.plan.index, f"no heartbeat from the node for {silent:.0f} s (network or node down?)")
        self._act_on_hang(self.hang.check(now, self.status, self.stop_requested))
        if self.stop_deadline is not None and now >= self.stop_deadline and self.kill_deadline is None:
            for status in self.status:
                if not status.terminal:
                    self.view.notice(f"{status.plan.label}: no stop confirmation; sending SIGKILL")
            self._kill_all(now)
        if self.kill_deadline is not None and now >= self.kill_deadline:
            for status in self.status:
                if not status.terminal:
                    self._set(status.plan.index, "lost", reason="did not confirm the stop; sweeping it")
                    self.sessions[status.plan.index].close()
                    self.sweeper.start(status.plan.config)

    def _act_on_hang(self, decision: AskStacks | Hung | None) -> None:
        if isinstance(decision, AskStacks):
            self.view.notice(f"job looks hung: {decision.why}; asking every rank for its Python stack")
            for node in decision.nodes:
                self.sessions[node].send(wire.Dump())
        elif isinstance(decision, Hung):
            self._fail(decision.node, decision.rank, None, decision.what)

    # --- failure and stop ---

    def _lost(self, node: int, what: str) -> None:
        what = self.status[node].slurm_cancel or what  # Slurm ended the step: not a lost network
        self._set(node, "lost", reason=what)
        self.sessions[node].close()
        if self.following:
            return  # only this view of the node is lost; the job there goes on under its supervisor
        self.sweeper.start(self.plan.nodes[node].config)
        if not self.stop_requested or self.interrupted is None:
            self._fail(node, None, None, what)

    def _fail(self, node: int, rank: int | None, code: int | None, what: str, at: float | None = None) -> None:
        label = self.plan.nodes[node].label
        self.failures.append(Failure(node, label, rank, code, what, at if at is not None else self.wall()))
        if self.following:
            self.stop_requested = True  # by the job's own supervisor, on the nodes
            return
        if not self.stop_requested:
            self.view.notice(f"{label} failed: {what}; stopping all nodes")
            self._request_stop(f"{label} failed")

    def _request_stop(self, reason: str) -> None:
        if self.stop_requested:
            return
        self.stop_requested = True
        self.stop_deadline = self.clock() + self.plan.stop_grace + STOP_MARGIN
        for session, status in zip(self.sessions, self.status):
            if status.state == "connecting":
                session.cancel()  # nothing can have started there
                self._set(status.plan.index, "stopped", reason="cancelled while connecting")
            elif not status.terminal:
                status.reason = reason
                session.send(wire.Stop())

    def _kill_all(self, now: float) -> None:
        """SIGKILL every job process still running; nodes that do not confirm in time are swept."""
        self._request_stop("kill requested")
        self.kill_deadline = now + KILL_MARGIN
        for session, status in zip(self.sessions, self.status):
            if not status.terminal:
                session.send(wire.Kill())

    def _error(self, node: int, problem: NodeProblem) -> None:
        self.status[node].problem = problem
        self._set(node, "error", reason=problem.what)

    def _set(self, node: int, state: State, reason: str | None = None) -> None:
        status = self.status[node]
        status.state = state
        if reason is not None:
            status.reason = reason
        if state in TERMINAL:
            status.ended_at = self.clock()
        self.view.node_state(status)
