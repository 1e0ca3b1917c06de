"""The job loop: open every node in parallel, start them together, watch, fail fast, clean up.

The main thread consumes one event queue (fed by session threads) and owns every decision;
per-node outcomes are values, and the first failure by time is named as the root cause.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Protocol

from . import protocol
from .cleanup import SweepReport, match_for, sweep_node
from .errors import NodeProblem, SetupError
from .events import Closed, Dumped, Exited, Lines, LogLine, Probed, Ready, SetupFailed, Started, Stopping
from .logparse import StackReport
from .outcome import TERMINAL, Failure, JobResult, JobSnapshot, NodeRow, NodeStatus, State
from .plan import LaunchPlan, NodePlan
from .session import NodeSession
from .transport import Transport, early_exit_problem, transport_for

STOP_MARGIN = 5.0  # beyond stop_grace before a node that has not confirmed its stop is SIGKILLed
KILL_MARGIN = 5.0  # after SIGKILL before the node is declared lost and swept over a new channel
SETUP_MARGIN = 30.0  # beyond connect_timeout for an agent to preflight and report ready
PROBE_TIMEOUT = 3.0  # for each node's TCP connect to the master
DUMP_WAIT = 5.0  # after asking for stacks, how long to wait for them before stopping the job
DUMP_SETTLE = 1.5  # after every node confirmed its dump signals, time for the stacks to arrive
SKEW_WARNING = 5.0  # seconds of clock difference worth a warning (logs and timeouts get confusing)


class View(Protocol):
    def lines(self, node: NodePlan, lines: list[LogLine]) -> None: ...
    def node_state(self, status: NodeStatus) -> None: ...
    def notice(self, text: str) -> None: ...
    def tick(self, snapshot: Callable[[], JobSnapshot]) -> None:
        """Called often from the job loop; a view that redraws builds the snapshot only when it does."""


TORCH_FIELDS = ("torch", "cuda", "nccl")


def torch_versions(info: dict, fields=TORCH_FIELDS) -> str:
    """``2.4.0+cu121 (CUDA 12.1, NCCL 2.20.5)``, naming only ``fields`` that are known."""
    extra = [f"{name} {info[key]}" for key, name in (("cuda", "CUDA"), ("nccl", "NCCL"))
             if key in fields and info.get(key)]
    return f"{info.get('torch') or '-'}" + (f" ({', '.join(extra)})" if extra else "")


def torch_build(info: dict, fields=TORCH_FIELDS) -> str:
    return f"torch {torch_versions(info, fields)}"


def torch_mismatches(statuses: list[NodeStatus], master_index: int) -> list[NodeProblem]:
    """torch, and the CUDA and NCCL it uses, must agree with the master's; a field a node could
    not read (NCCL from conda, say) is not compared."""
    master = statuses[master_index]
    problems = []
    for s in statuses:
        differ = [key for key in TORCH_FIELDS if _differs(key, s.info, master.info)]
        if differ:
            problems.append(NodeProblem(s.plan.label, f"{torch_build(s.info, differ)} here, "
                                        f"{torch_build(master.info, differ)} on the master ({master.plan.label})",
                                        "install the same torch build (CUDA, NCCL) on every node"))
    return problems


def _differs(key: str, mine: dict, theirs: dict) -> bool:
    a, b = mine.get(key), theirs.get(key)
    return a != b and (key == "torch" or bool(a and b))


class Job:
    def __init__(self, plan: LaunchPlan, view: View,
                 transport_factory: Callable[[object], Transport] = transport_for,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 preflight: bool = True):
        self.plan = plan
        self.preflight = preflight
        self.view = view
        self.clock = clock
        self.wall = wall
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.transport_factory = transport_factory
        self.sessions = [NodeSession(plan, n, transport_factory(n.config), self.events.put, clock)
                         for n in plan.nodes]
        self.status = [NodeStatus(n) for n in plan.nodes]
        self.failures: list[Failure] = []
        self.master_port = plan.master_port
        self.interrupted: int | None = None
        self.stop_requested = False
        self.stop_deadline: float | None = None
        self.kill_deadline: float | None = None
        self.started = clock()
        self.sweeps: list[SweepReport] = []
        self._next_heartbeat = 0.0
        self.last_output: float | None = None  # any rank's latest line (hang detection)
        self.rank_last: dict[int, float] = {}
        self.first_done: float | None = None
        self.hang: str | None = None  # why the job was declared hung
        self.stacks = StackReport()
        self.dump_pending: set[int] = set()
        self.dump_deadline: float | None = None
        self._sweepers: list[threading.Thread] = []
        self._sweep_results: list[SweepReport] = []

    # --- the three phases ---

    def run(self) -> JobResult:
        """Connect + preflight everywhere, start everywhere at once, supervise to the end."""
        self._open_all()
        problems = self._await_ready()
        if not problems and self.preflight:
            problems = self._check_nodes()
        if problems:
            raise SetupError(problems)
        self._go()
        self._drain()
        return self.result()

    def stop(self, signum: int | None = None, reason: str = "") -> JobResult:
        """Graceful stop of every node (Ctrl-C, SIGTERM, SIGHUP): idempotent."""
        if signum is not None and self.interrupted is None:
            self.interrupted = signum
        self._request_stop(reason or "stop requested")
        self._drain()
        return self.result()

    def kill(self) -> JobResult:
        """Immediate SIGKILL of every job process (second Ctrl-C)."""
        self._request_stop("kill requested")
        self.kill_deadline = self.clock() + KILL_MARGIN
        for session, status in zip(self.sessions, self.status):
            if not status.terminal:
                session.send(protocol.KILL)
        self._drain()
        return self.result()

    def close(self) -> None:
        """Always called (finally): drop connections, then sweep any node that was lost."""
        for session in self.sessions:
            session.cancel()
        with ThreadPoolExecutor(max_workers=min(64, len(self.sessions))) as pool:
            list(pool.map(lambda s: s.disconnect(), self.sessions))
        self.sweeps.extend(self._finish_sweeps())  # the same list a result taken earlier holds

    def snapshot(self) -> JobSnapshot:
        now = self.clock()
        rows = tuple(NodeRow(
            s.plan.index, s.plan.label, s.plan.ranks, s.state,
            None if s.started_at is None else (s.ended_at or now) - s.started_at,
            s.lines, s.last_line, s.signal or ("" if s.exit_code is None else str(s.exit_code)), s.reason)
            for s in self.status)
        return JobSnapshot(self.plan.job_id, f"{self.plan.master_addr}:{self.master_port or 'auto'}",
                           self.plan.world_size, now - self.started, self._phase(), rows, now)

    def _phase(self) -> str:
        if all(s.terminal for s in self.status):
            return "done" if all(s.state == "done" for s in self.status) else "failed"
        if self.stop_requested:
            return "failing" if self.failures and not self.interrupted else "stopping"
        if any(s.state in ("connecting", "ready") for s in self.status):
            return "connecting"
        return "running"

    def result(self) -> JobResult:
        return JobResult(self.plan, self.status, self.master_port, list(self.failures), self.interrupted,
                         self.sweeps, self.clock() - self.started)

    # --- phase 1: connect and preflight ---

    def check(self) -> list[NodeProblem]:
        """Connect, preflight and probe every node, start nothing (ddp-check)."""
        self._open_all()
        problems = self._await_ready()
        if self.master_port is not None and all(s.state == "ready" for s in self.status):
            problems += self._check_nodes()
        return problems

    def _open_all(self) -> None:
        for session in self.sessions:
            # Daemon threads, not an executor: a connect stuck on a dead host must not delay exit.
            threading.Thread(target=session.open, name=f"connect-{session.node.label}", daemon=True).start()

    def _await_ready(self) -> list[NodeProblem]:
        deadline = self.clock() + max(n.config.ssh.connect_timeout for n in self.plan.nodes) + SETUP_MARGIN
        problems: dict[int, NodeProblem] = {}
        while any(s.state == "connecting" for s in self.status):
            event = self._next(deadline)
            if event is None and self.clock() >= deadline:
                for s in self.status:
                    if s.state == "connecting":
                        problems[s.plan.index] = NodeProblem(s.plan.label, "no ready report from the node agent",
                                                             "check the node's load and filesystem")
                        s.state = "error"
                break
            if isinstance(event, SetupFailed):
                problems[event.node] = event.problem
                self._set(event.node, "error", reason=event.problem.what)
            elif isinstance(event, Closed) and self.status[event.node].state == "connecting":
                problems[event.node] = self._early_exit_problem(event)
                self._set(event.node, "error", reason=problems[event.node].what)
            elif event is not None:
                self._handle(event)
        return [problems[k] for k in sorted(problems)]

    def _check_nodes(self) -> list[NodeProblem]:
        """Across nodes: the same torch as the master, and a real TCP path to master addr:port."""
        problems = torch_mismatches(self.status, self.plan.master.index) + gpu_shortfalls(self.status)
        for session in self.sessions:
            session.send(protocol.probe(self.plan.master_addr, self.master_port, PROBE_TIMEOUT))
        deadline = self.clock() + PROBE_TIMEOUT + 10
        while any(s.reach is None for s in self.status) and self.clock() < deadline:
            event = self._next(deadline)
            if isinstance(event, Probed):
                self.status[event.node].reach = event
            elif event is not None:
                self._handle(event)
        target = f"{self.plan.master_addr}:{self.master_port}"
        for s in self.status:
            if s.reach is None or not s.reach.ok:
                why = s.reach.error if s.reach else "no answer to the probe"
                problems.append(NodeProblem(s.plan.label, f"cannot reach the master at {target} ({why})",
                                            "check master.addr is the address nodes use to reach the master, "
                                            "and that no firewall blocks the port"))
        for s in self.status:
            if s.clock_skew is not None and abs(s.clock_skew) > SKEW_WARNING:
                self.view.notice(f"{s.plan.label}: clock differs from this machine's by {s.clock_skew:+.1f} s")
        return problems

    def _early_exit_problem(self, event: Closed) -> NodeProblem:
        return early_exit_problem(self.plan.nodes[event.node].config, event.exit_status, event.stderr_tail)

    # --- phase 2: go ---

    def _go(self) -> None:
        if self.master_port is None:
            raise SetupError([NodeProblem(self.plan.master.label, "the master did not report a free port")])
        self.last_output = self.clock()
        for session, status in zip(self.sessions, self.status):
            session.send(protocol.go(self.plan.launcher_argv(session.node, self.master_port)))
            status.state = "starting"
            status.started_at = self.clock()
            self.view.node_state(status)

    # --- phase 3: supervise until every node is terminal ---

    def _drain(self) -> None:
        while not all(s.terminal for s in self.status):
            event = self._next(self._soonest_deadline())
            if event is not None:
                self._handle(event)
            self._watch()

    def _next(self, deadline: float | None) -> object | None:
        now = self.clock()
        wait = min(self.plan.heartbeat, 0.25) if deadline is None else max(0.0, min(deadline - now, 0.25))
        try:
            return self.events.get(timeout=wait)
        except queue.Empty:
            return None
        finally:
            self._heartbeat()
            self.view.tick(self.snapshot)

    def _soonest_deadline(self) -> float | None:
        times = [t for t in (self.stop_deadline, self.kill_deadline, self.dump_deadline) if t is not None]
        return min(times) if times else None

    def _heartbeat(self) -> None:
        now = self.clock()
        if now < self._next_heartbeat:
            return
        self._next_heartbeat = now + self.plan.heartbeat
        for session, status in zip(self.sessions, self.status):
            if not status.terminal and session.proc is not None:
                session.send(protocol.HEARTBEAT)

    def _handle(self, event: object) -> None:
        if isinstance(event, Lines):
            self._lines(event)
        elif self.status[event.node].terminal:
            return  # e.g. a cancelled connect finishing late: its outcome is already decided
        elif isinstance(event, Ready):
            self._ready(event)
        elif isinstance(event, Started):
            self.status[event.node].pid = event.pid
            self._set(event.node, "running")
        elif isinstance(event, Dumped):
            self.dump_pending.discard(event.node)
            if not self.dump_pending and self.dump_deadline is not None:
                self.dump_deadline = min(self.dump_deadline, self.clock() + DUMP_SETTLE)
        elif isinstance(event, Stopping):
            self._set(event.node, "stopping", reason=event.reason)
        elif isinstance(event, Exited):
            self._exited(event)
        elif isinstance(event, Closed):
            self._closed(event)
        elif isinstance(event, SetupFailed):
            self._set(event.node, "stopped", reason=event.problem.what)  # cancelled while connecting

    def _ready(self, event: Ready) -> None:
        status = self.status[event.node]
        status.info = event.info
        if "time" in event.info:
            status.clock_skew = float(event.info["time"]) - self.wall()
        if "port" in event.info and self.master_port is None:
            self.master_port = int(event.info["port"])
        if not self.status[event.node].terminal:
            self._set(event.node, "ready")

    def _lines(self, event: Lines) -> None:
        if self.plan.secrets:  # before anything keeps or shows a line
            event = Lines(event.node, [line._replace(text=self.plan.mask(line.text)) for line in event.lines])
        status = self.status[event.node]
        for line in event.lines:
            if line.rank is None and line.stream != "node":
                status.report.feed(line.text)
        now = self.clock()
        for line in event.lines:
            if line.rank is not None:
                self.last_output = self.rank_last[line.rank] = now
                if self.hang and line.stream == "err":
                    self.stacks.feed(line.rank, line.text)
        status.lines += len(event.lines)
        status.last_line = event.lines[-1].text
        self.view.lines(status.plan, event.lines)

    def _exited(self, event: Exited) -> None:
        status = self.status[event.node]
        status.exit_code, status.signal = event.code, event.signal
        if self.stop_requested and (event.stopped or event.code != 0):
            self._set(event.node, "stopped", reason=status.reason or event.reason)
        elif event.stopped:
            self._set(event.node, "stopped", reason=event.reason)
            self._fail(event.node, None, event.code, f"stopped on the node: {event.reason}")
        elif event.code == 0:
            self._set(event.node, "done")
            self.first_done = self.first_done or self.clock()
        else:
            self._set(event.node, "failed", reason=f"launcher exited with {_describe_code(event.code, event.signal)}")
            root = status.report.root
            rank = root.rank if root else None
            code = root.exit_code if root and root.exit_code is not None else event.code
            what = f"rank {rank} exited with code {code}" if rank is not None else status.reason
            self._fail(event.node, rank, code, what, at=root.time if root else None)

    def _closed(self, event: Closed) -> None:
        status = self.status[event.node]
        if status.terminal:
            return
        tail = "; ".join(event.stderr_tail[-2:])
        what = "connection to the node agent lost" + (f" ({tail})" if tail else "")
        self._lost(event.node, what)

    def _lost(self, node: int, what: str) -> None:
        self._set(node, "lost", reason=what)
        self.sessions[node].close()
        self._start_sweep(self.plan.nodes[node])
        if not self.stop_requested or self.interrupted is None:
            self._fail(node, None, None, what)

    def _watch(self) -> None:
        """Heartbeat deadlines, hangs, and escalation when nodes do not confirm a stop."""
        now = self.clock()
        self._watch_hang(now)
        for session, status in zip(self.sessions, self.status):
            silent = now - session.last_heard
            if not status.terminal and session.proc is not None and silent > self.plan.orphan_timeout:
                self._lost(status.plan.index, f"no heartbeat from the node for {silent:.0f} s (network or node down?)")
        if self.stop_deadline is not None and now >= self.stop_deadline and self.kill_deadline is None:
            self.kill_deadline = now + KILL_MARGIN
            for session, status in zip(self.sessions, self.status):
                if not status.terminal:
                    self.view.notice(f"{status.plan.label}: no stop confirmation; sending SIGKILL")
                    session.send(protocol.KILL)
        if self.kill_deadline is not None and now >= self.kill_deadline:
            for status in self.status:
                if not status.terminal:
                    self._set(status.plan.index, "lost", reason="did not confirm the stop; sweeping it")
                    self.sessions[status.plan.index].close()
                    self._start_sweep(status.plan)

    # --- hangs ---

    def _watch_hang(self, now: float) -> None:
        limit = self.plan.hang_timeout
        if self.dump_deadline is not None and now >= self.dump_deadline:
            self.dump_deadline = None
            self._fail_hung()
        if not limit or self.hang or self.stop_requested or self.last_output is None:
            return
        running = [s for s in self.status if s.state == "running"]
        if not running:
            return
        quiet = now - self.last_output
        if quiet > limit:
            self._declare_hang(f"no output from any rank for {quiet:.0f} s")
        elif self.first_done is not None and now - self.first_done > limit:
            done = sum(s.state == "done" for s in self.status)
            self._declare_hang(f"{done} node(s) finished {now - self.first_done:.0f} s ago, "
                               f"{len(running)} still running")

    def _declare_hang(self, why: str) -> None:
        self.hang = why
        self.view.notice(f"job looks hung: {why}; asking every rank for its Python stack")
        for session, status in zip(self.sessions, self.status):
            if status.state == "running":
                self.dump_pending.add(status.plan.index)
                session.send(protocol.DUMP)
        self.dump_deadline = self.clock() + DUMP_WAIT

    def _fail_hung(self) -> None:
        """Name the ranks that look stuck, then stop the job as a failure.

        With stacks: the odd ones out, i.e. the smallest group by the collective they wait in
        (one rank in all_reduce while the rest are elsewhere, or the reverse). Without: the
        ranks on nodes still running, quietest first.
        """
        running = [r for s in self.status if s.state == "running" for r in s.plan.ranks]
        if not running:
            return
        odd = [r for r in self.stacks.odd_ones_out() if r in running]
        if odd:
            stuck = odd
            detail = "; ".join(f"rank {r} {self.stacks.describe(r)}" for r in odd[:4])
            others = sorted(set(self.stacks.collective) - set(odd))
            if others:
                detail += f"; the other {len(others)} rank(s) {self.stacks.describe(others[0])}"
        else:
            stuck = sorted(running, key=lambda r: self.rank_last.get(r, 0.0))
            detail = "quietest ranks first: " + ", ".join(map(str, stuck[:8])) + (" ..." if len(stuck) > 8 else "")
        node = next(s.plan.index for s in self.status if stuck[0] in s.plan.ranks)
        self._fail(node, stuck[0], None, f"job hung ({self.hang}); {detail}; "
                                         f"stacks in the log above and in runs/{self.plan.job_id}/")

    # --- failure and stop ---

    def _fail(self, node: int, rank: int | None, code: int | None, what: str, at: float | None = None) -> None:
        label = self.plan.nodes[node].label
        self.failures.append(Failure(node, label, rank, code, what, at if at is not None else self.wall()))
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
                session.send(protocol.STOP)

    def _set(self, node: int, state: State, reason: str | None = None) -> None:
        status = self.status[node]
        status.state = state
        if reason is not None:
            status.reason = reason
        if state in TERMINAL:
            status.ended_at = self.clock()
        self.view.node_state(status)

    def _start_sweep(self, node: NodePlan) -> None:
        """A lost node may still run job processes: sweep them over a fresh connection, now,
        in parallel with stopping the other nodes."""

        def sweep() -> None:
            match = match_for(job=self.plan.job_id, node=node.index)
            self._sweep_results.append(sweep_node(node.config, match, grace=self.plan.stop_grace,
                                                  transport=self.transport_factory(node.config)))

        thread = threading.Thread(target=sweep, name=f"sweep-{node.label}", daemon=True)
        thread.start()
        self._sweepers.append(thread)

    def _finish_sweeps(self) -> list[SweepReport]:
        for thread in self._sweepers:  # each sweep bounds itself (connect timeout, grace)
            thread.join(self.plan.stop_grace + max(n.config.ssh.connect_timeout for n in self.plan.nodes) + 20)
        for report in self._sweep_results:
            if report.error:
                self.view.notice(f"{report.node.label}: cleanup not confirmed ({report.error}); its agent stops the "
                                 f"job by itself within orphan_timeout ({self.plan.orphan_timeout:g} s), "
                                 f"or run ddp-kill")
            elif report.found:
                self.view.notice(f"{report.node.label}: swept {len(report.found)} leftover process(es)")
        return list(self._sweep_results)


def gpu_shortfalls(statuses: list[NodeStatus]) -> list[NodeProblem]:
    """Nodes asked to run more processes than they have GPUs. A node with no GPU detected is
    left alone: CPU jobs (gloo) are legitimate, and the driver may not expose /proc there."""
    problems = []
    for s in statuses:
        have = s.info.get("gpus") or 0
        if 0 < have < s.plan.nproc:
            problems.append(NodeProblem(s.plan.label, f"gpus: {s.plan.nproc} but the node has {have} GPU(s)",
                                        f"set `gpus: {have}` for this node"))
    return problems


def _describe_code(code: int | None, signal: str | None) -> str:
    if signal:
        return f"signal {signal}"
    return f"code {code}"
