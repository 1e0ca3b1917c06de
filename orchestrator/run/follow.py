"""Following a detached job from the controller: its journals replayed as a live run, attempt by attempt.

A job started with ``ddp-up --detach`` keeps a journal on each node (node/local/state.py's Journal): every frame
its agent would have sent to ddp-up, in order. Attaching replays each node's journal through the
same job loop and views as a live run (``Job.follow``): from the job's first line, then live,
until the job has ended everywhere. Nothing is ever sent to the job: its own agents supervise it
(node/supervise/supervisor.py), so an attach (or its Ctrl-C) cannot change its course. The run logs under
``runs/<job>/`` are written again from the journals, so they hold every line exactly once
whatever attaches and detaches happened.
"""

from __future__ import annotations

import dataclasses
import os
import time

from ..job.events import Reshape
from ..job.loop import Job
from ..job.session import NodeSession
from ..node.protocol import wire
from ..plan.launch import LaunchPlan, make_plan
from ..remote.transports import transport_for
from .attempts import AttemptRecord, attempt_record, blame


def follow_plan(config, job_id: str, master: str | None = None, script: str | None = None) -> LaunchPlan:
    """The plan a journal is read against: the cluster's nodes and ranks (as launched from this
    cluster file), no hang watch of its own (the job's agents have theirs), and the master's port
    and the script the job was given, where its record says (``master``: ``addr:port``): the
    replay's summary.json names them as the run's own does."""
    port = master.rpartition(":")[2] if master else ""
    return dataclasses.replace(make_plan(config, script or "(detached)", [], job_id, os.getcwd()), hang_timeout=None,
                               startup_timeout=None, **({"master_port": int(port)} if port.isdigit() else {}))


def on_nodes(plan: LaunchPlan, full: LaunchPlan, nodes: list[int] | None) -> LaunchPlan:
    """The plan of an elastic job's attempt on ``nodes`` (indices in the cluster file; None: every
    node), as its supervisor laid it out (node/supervise/members.place): those nodes in order,
    numbered from 0 with their ranks without gaps; each still reads its own journal (config.rank)."""
    if nodes is None:
        nodes = [n.index for n in full.nodes]
    kept, first = [], 0
    for node in (n for n in full.nodes if n.index in nodes):
        kept.append(dataclasses.replace(node, index=len(kept), first_rank=first))
        first += node.nproc
    out = tuple(n.label for n in full.nodes if n.index not in nodes)  # away, or out for good: as an attached run's
    return dataclasses.replace(plan, nodes=tuple(kept), quarantined=out)


def supervisors_loss(job: Job, full: LaunchPlan) -> bool:
    """Where the journals name no root cause, the node the job's supervisor found lost is it, with
    the supervisor's reason, recorded as an attached run records a loss (the node lost, a failure
    of its own): the replay's summary, its attempts and its end say the same. Whether it was."""
    lost, why = job.following.lost, job.following.lost_why
    label = next((n.label for n in full.nodes if n.index == lost), None)
    node = next((n.index for n in job.plan.nodes if n.label == label), None)
    if node is None or job.result().root_cause is not None:
        return False
    job.table.set(node, "lost", reason=why or "lost")
    job.fail(node, None, None, why or "lost", kind="lost")
    return True


def unread_in_next(job: Job, full: LaunchPlan, nodes: list[int] | None) -> bool:
    """Whether a node whose journal could not be read this attempt runs the next one too (``nodes``:
    indices in the cluster file, None: every node): the attach ends there, naming it. One the
    supervisor left out (lost while the job waited to restart, say) holds no later attempt back."""
    labels = {n.label for n in full.nodes if nodes is None or n.index in nodes}
    return any(s.problem and s.plan.label in labels for s in job.status)


def journal_sessions(follow: bool, tail: int | None = None):
    def make(plan: LaunchPlan, post, clock) -> list[NodeSession]:
        return [NodeSession(plan, n, transport_for(n.config), post, clock,  # the journal of the node the file names
                            follow=wire.FollowSpec(job=plan.job_id, node=n.config.rank, follow=follow,
                                                   heartbeat=plan.heartbeat, tail=tail, attempt=plan.attempt))
                for n in plan.nodes]
    return make


def follow_attempts(plan: LaunchPlan, views, follow: bool, tail: int | None, inbox,
                    sessions=journal_sessions, shown: frozenset[int] | None = None,
                    timeline=None, metrics=None) -> tuple[Job, list[AttemptRecord]]:
    """Every attempt of a detached job that restarted (``restarts:``), one after the other, as a
    run that restarts shows them: the Job of the last, and a record of each. ``timeline``
    (views/timeline.py) and ``metrics`` (views/metricsfile.py) take each replayed frame's own
    time, not the replay's."""
    records: list[AttemptRecord] = []
    last, full = None, plan
    while True:
        job = Job(plan, views, sessions=sessions(follow, tail), inbox=inbox, shown=shown)
        for kept in (timeline, metrics):  # each replayed frame's own time, not the replay's
            if kept is not None:
                kept.recorded = lambda job=job: job.pace.recorded
        started = time.time()
        try:
            result = job.follow()
        finally:
            job.close()
        if last is not None and job.interrupted is None and len(job.following.absent) == len(job.status):
            return last, records  # it was stopped while it waited to restart: the attempt before was its last
        if supervisors_loss(job, full):
            result = job.result()
        # the supervisor's reshape, for the attempt's end only (attempts.attempt_end reads Reshape.end)
        reshaped = job.following.reshaped
        record = attempt_record(plan, result, started, blame(result),
                                reshape=Reshape("", aside="(its supervisor's)" if reshaped == "aside" else None)
                                if reshaped else None)
        ran_on = record.end not in ("succeeded", "stopped")  # what came next, as an attached run says it
        records.append(dataclasses.replace(record, next=job.following.next) if ran_on else record)
        if job.interrupted or job.following.over or not job.following.later_attempt or \
                unread_in_next(job, full, job.following.nodes):
            return job, records
        if ran_on and job.following.next:  # the supervisor's decision, worded as an attached run's
            views.notice(f"attempt {plan.attempt} {record.end} ({record.root_cause or 'see above'}); "
                         f"attempt {plan.attempt + 1} ({job.following.next})")
        last, plan = job, on_nodes(dataclasses.replace(plan, attempt=plan.attempt + 1), full, job.following.nodes)
        views.attempt(plan)
