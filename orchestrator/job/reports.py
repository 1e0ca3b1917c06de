"""What the nodes say, for the job loop: their frames, lines and ends, each turned into the state
change it means (on the job's NodeTable) and the asks the loop applies to the job's own state
(events.py: a master port, a failure, a lost node, a stop by ddp-kill, a journal read).
"""

from __future__ import annotations

import re
from dataclasses import replace

from ..diagnose import preflight
from ..diagnose.rankfailures import node_clock, own_failures, rank_ends, rank_errors
from ..errors import NodeProblem
from ..node.protocol import policy, wire
from .hang import LINGERED
from .events import (Ask, ChannelEnded, Closed, JournalRead, KilledBy, Lines, Lost, MasterPort, Message, Record,
                     Reshape, SetupFailed, SupervisorPort)

LAST_LINE = 240  # characters of a node's latest line kept for the dashboard

# slurmstepd's word when Slurm ends a step (scancel, the allocation's end, its time limit)
SLURM_CANCEL = re.compile(r"\*\*\* (STEP|JOB) (\S+) ON (\S+) CANCELLED AT \S+(?: DUE TO ([A-Z ]+?))? \*\*\*")

BY_DDP_KILL = "stopped by ddp-kill"  # every node's detail when ddp-kill stopped the job on one


SLURM_CANCELLED = "Slurm cancelled"  # how a failure that Slurm's end of a step became begins


def slurm_cancel(text: str) -> str | None:
    """What a node's line says Slurm did to its step, if it says so."""
    m = SLURM_CANCEL.search(text)
    if m is None:
        return None
    why = f" due to {m.group(4).lower()}" if m.group(4) else " (scancel, or the allocation ended)"
    return f"{SLURM_CANCELLED} {m.group(1).lower()} {m.group(2)}{why}"


def slurms(failure, cancel: str | None):
    """``failure`` as Slurm's doing where Slurm ended the node's step (``cancel``: its word) and the
    failure is the node's end or a rank's death by a signal: Slurm signals every process of the step."""
    if cancel is None or not (failure.rank is None or (failure.exit_code or 0) < 0):
        return failure
    return replace(failure, what=cancel, kind="outside")


def overran(reason: str | None, killed: int, grace: float) -> str | None:
    """A stopped node's reason, and what its stop cut short: ``killed`` processes still there at
    the end of stop_grace (a save that took longer), killed by the agent or by torchrun."""
    if killed <= 0:
        return reason
    cut = f"{killed} process(es) killed at the end of stop_grace ({grace:g} s): a save took longer?"
    return f"{reason}; {cut}" if reason else cut


class NodeReports:
    """Each event turned into the node's new status (on the NodeTable) and the asks (events.py)
    that the loop applies to the job's own state. Holds what it reads and feeds, not the Job."""

    def __init__(self, plan, table, view, stop, watchers, clock, wall):
        self.plan, self.table, self.view, self.stop = plan, table, view, stop  # stop: read only (requested)
        self.hang, self.flight, self.pace = watchers  # what the lines and frames feed
        self.clock, self.wall = clock, wall
        self.following = None  # the Job's Following while it follows a detached job (read only)

    def handle(self, event: object) -> list[Ask]:
        if isinstance(event, Reshape):
            return [event]  # the run's, not a node's: the loop decides
        asks: list[Ask] = [ChannelEnded(event.node)] if isinstance(event, Closed) else []
        if isinstance(event, Lines):
            self.lines(event)
        elif self.following and isinstance(event, Message) and isinstance(event.frame, wire.JournalEnd):
            asks += self.journal_end(event.node, event.frame)
        elif self.table[event.node].terminal or (self.following and event.node in self.following.journal_ended):
            pass  # e.g. a cancelled connect finishing late: its outcome is already decided
        elif isinstance(event, Message):
            asks += self.message(event.node, event.frame)
        elif isinstance(event, Closed):
            asks += self.closed(event)
        elif isinstance(event, SetupFailed):
            if self.table[event.node].state == "connecting" and not self.stop.requested:
                self.table.error(event.node, event.problem)
            else:
                self.table.set(event.node, "stopped", reason="cancelled while connecting")
        return asks

    def message(self, node: int, frame: wire.Frame) -> list[Ask]:
        status = self.table[node]
        if isinstance(frame, wire.Ready) and status.state == "connecting":
            return self.ready(node, frame)
        if isinstance(frame, wire.Failed) and status.state == "connecting":
            self.table.error(node, NodeProblem(status.plan.label, frame.what, frame.fix))
        elif isinstance(frame, wire.Probed):
            status.reach = frame
        elif isinstance(frame, wire.Started):
            self.table.set(node, "running")
        elif isinstance(frame, wire.GpuUsage):
            status.gpus = frame.gpus
            self.view.gpus(status.plan, frame.gpus, at=self.pace.recorded)
        elif isinstance(frame, wire.Dumped):
            self.hang.dumped(node, self.clock())
        elif isinstance(frame, wire.RanksEnded):
            self.hang.ranks_ended(node, self.clock())
        elif isinstance(frame, wire.Collectives):
            self.flight.collectives(frame.ranks, status.plan.ranks)
        elif isinstance(frame, (wire.Arrivals, wire.Bars)):
            self.pace.frame(node, frame)
        elif isinstance(frame, wire.RanksUp):  # the node's own ranks only: the list is the job's to plant
            ranks = status.plan.ranks
            self.hang.ranks_up([r for r in frame.ranks[:len(ranks)] if type(r) is int and r in ranks], self.clock())
        elif isinstance(frame, wire.Stopping):
            # a node ddp-up stopped because ddp-kill stopped another says what the user did, as that one does
            keep = frame.by is None and status.reason == BY_DDP_KILL
            self.table.set(node, "stopping", reason=BY_DDP_KILL if keep else frame.reason)
            if frame.by == "ddp-kill":
                return [KilledBy(node)]
            if frame.by == "signal" and not self.following:
                return [self.stopped_outside(node, frame)]
        elif isinstance(frame, wire.Result) and type(frame.rank) is int and frame.rank in status.plan.ranks:  # its own
            status.results[frame.rank] = frame.problem or frame.data
        elif isinstance(frame, wire.Exited):
            return self.exited(node, frame)
        else:
            return [Lost(node, f"protocol error from the node agent: unexpected {type(frame).__name__} "
                               f"while {status.state}")]
        return []

    def ready(self, node: int, frame: wire.Ready) -> list[Ask]:
        status = self.table[node]
        status.info = frame.fields()
        known = self.plan.vetted.get(status.plan.label)
        if known and frame.torch is None:  # vetted in an earlier attempt: its agent did not probe torch again
            status.info.update(known)
        status.clock_skew = frame.time - self.wall()
        self.table.set(node, "ready")
        asks: list[Ask] = [] if frame.port is None else [MasterPort(frame.port)]
        if frame.supervisor_port is not None and node == self.plan.master.index:
            asks.append(SupervisorPort(frame.supervisor_port))
        return asks

    def lines(self, event: Lines) -> None:
        status = self.table[event.node]
        for line in event.lines:
            if line.rank is None and line.stream != "node":
                status.report.feed(line.text)
            elif line.stream == "node" and status.slurm_cancel is None:
                status.slurm_cancel = slurm_cancel(line.text)
                if status.slurm_cancel is not None:
                    self.blame_slurm(event.node)
        self.hang.lines(event.lines, self.clock())
        self.flight.lines(event.lines)
        self.pace.lines(event.node, event.lines)
        status.lines += len(event.lines)
        status.last_line = event.lines[-1].text[:LAST_LINE]
        if status.state == "stopping" and (self.stop.requested or self.following):
            # the launcher's own report of a stop ddp-up asked for (torchrun's SignalException
            # traceback, ~40 lines a node) goes to the node's log file only; so does a detached
            # job's, at each stop its supervisor made (a failure elsewhere, a grow, a node set aside)
            kept = [line for line in event.lines if line.rank is None and line.stream != "node"]
            if kept:
                getattr(self.view, "kept_lines", lambda *_: None)(status.plan, kept)
                event = Lines(event.node, [line for line in event.lines if line.rank is not None or
                                           line.stream == "node"])
        if event.lines:
            self.view.lines(status.plan, event.lines)

    def stopped_outside(self, node: int, frame: wire.Stopping) -> Record:
        """The job stops on a node by no one's word from here (Slurm's time limit or preemption, a
        shutdown, a signal to the agent): not the job's own failure (attempts.py), and at the time
        the agent began to stop, before its ranks died and their peers failed of it. Every other
        node stops with its grace at once."""
        status = self.table[node]
        known = isinstance(frame.at, (int, float)) and not isinstance(frame.at, bool)
        at = node_clock(frame.at, status.clock_skew) if known else None  # the one rule for a node's times
        return Record(self.table.failure(node, None, None, status.slurm_cancel or f"stopped on the node: {frame.reason}",
                                         at, "outside"))

    def blame_slurm(self, node: int) -> None:
        """Slurm's word comes on the step's stderr, which can arrive after the node's end (the agent
        stopped on Slurm's SIGTERM, or its srun ended): that end was Slurm's doing. So was a rank's
        death by a signal there: Slurm signals every process of the step, and a rank may die of
        it before its agent acts on its own."""
        status = self.table[node]
        self.table.failures[:] = [slurms(f, status.slurm_cancel) if f.node == node else f for f in self.table.failures]
        if status.state in ("stopped", "lost"):
            status.reason = status.slurm_cancel

    def exited(self, node: int, frame: wire.Exited) -> list[Ask]:
        """The node's end. A node whose ranks failed by themselves is failed, with each failure
        at its own time, whenever it is heard (after a stop too: the root cause is the earliest,
        not the first reported); one that ended because a stop was asked for is stopped."""
        status = self.table[node]
        status.exit_code, status.signal = frame.code, frame.signal
        status.rank_errors = rank_errors(frame.failures, status.plan.ranks.start)
        if frame.gpu_left:
            self.view.notice(f"{status.plan.label}: {len(frame.gpu_left)} process(es) of this job still hold GPU "
                             f"memory after its end: {preflight.busy_gpu_text(frame.gpu_left)}")
        ends = rank_ends(frame.ends, status.plan.ranks.start)
        own = [] if frame.code == 0 and not frame.stopped else own_failures(
            node, status.plan.label, status.report, status.rank_errors, ends, status.clock_skew)
        how = f"signal {frame.signal}" if frame.signal else f"code {frame.code}"
        asked = self.stop.requested and (frame.stopped or frame.code != 0)  # a stop ddp-up asked for
        state = policy.node_end(bool(own), frame.stopped or asked, frame.code)  # the node's own rule
        if own and policy.warm_died(frame.reason):  # their exit statuses went with it: say why
            own = [f if f.exception else replace(f, exception=frame.reason) for f in own]
        if own:  # the ranks' own ends, not only torchrun's 1
            self.table.set(node, "failed", reason=ranks_ended(own, f"launcher exited with {how}"))
            return [Record(slurms(failure, status.slurm_cancel)) for failure in own]  # Slurm's word may come first
        if asked and self.stop.reason == LINGERED and node in self.hang.finishing:
            # its ranks had all ended well: only its launcher was stopped, at torchrun's exit barrier
            self.table.set(node, "done", reason="every rank ended; its launcher was stopped at torchrun's exit barrier")
            self.hang.node_done(self.clock())
            return []
        if asked:
            cut = (frame.overran if isinstance(frame.overran, int) else 0) + status.report.forced
            self.table.set(node, "stopped", reason=overran(status.reason or frame.reason, cut, self.plan.stop_grace))
        elif state == "stopped" and policy.controller_lost(frame.reason) and not self.following:
            # its link dropped for orphan_timeout and came back: the node was lost for a while
            silent = frame.reason[len(policy.CONTROLLER_SILENT):].strip()
            what = f"its link dropped for a while: the node heard nothing from ddp-up for {silent} and stopped its ranks"
            self.table.set(node, "lost", reason=what)
            return [Record(self.table.failure(node, None, frame.code, what, None, "lost"))]
        elif state == "stopped":
            self.table.set(node, "stopped", reason=status.slurm_cancel or frame.reason)
            if not self.following:  # a detached job's nodes stop when another fails: that one is the cause
                return [Record(self.table.failure(node, None, frame.code, status.slurm_cancel or
                                                  f"stopped on the node: {frame.reason}", None, "outside"))]
        elif state == "done":  # with the node's word on it, if any (a death in teardown after the scripts' end)
            self.table.set(node, "done", reason=frame.reason)
            self.hang.node_done(self.clock())
        else:
            self.table.set(node, "failed", reason=frame.reason or f"launcher exited with {how}")
            failure = self.table.failure(node, None, frame.code, frame.reason or status.reason)
            return [Record(replace(failure, exception=status.report.exception))]  # torchrun's own: its store, its rendezvous
        return []

    def closed(self, event: Closed) -> list[Ask]:
        status = self.table[event.node]
        if status.state == "connecting":
            self.table.error(event.node, event.end.problem(status.plan.config, "before it was ready"))
            return []
        if event.end.protocol_error:
            what = f"protocol error from the node agent: {event.end.protocol_error}"
        else:
            tail = "; ".join(event.end.stderr_tail[-2:])
            what = "connection to the node agent lost" + (f" ({tail})" if tail else "")
        return [Lost(event.node, what)]

    def journal_end(self, node: int, frame: wire.JournalEnd) -> list[Ask]:
        """Following: this node's journal was read to its end; whether a later attempt follows."""
        if not frame.absent and not frame.running and not self.table[node].terminal:
            self.table.set(node, "lost", reason="its journal ends before the job's end there (its agent was killed?)")
        return [JournalRead(node, frame)]


def ranks_ended(own: list, launcher: str) -> str:
    """A failed node's detail: its first failed rank's own end, how many more, then the launcher's
    (``rank 2 exited with code 3 (+1 more rank; launcher exited with code 1)``)."""
    first = min(own, key=lambda f: float("inf") if f.at is None else f.at)
    more = f"+{len(own) - 1} more rank{'s' if len(own) > 2 else ''}; " if len(own) > 1 else ""
    return f"{first.what} ({more}{launcher})"
