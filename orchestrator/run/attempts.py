"""Restarts and spare nodes: a failed job comes back by itself (``restarts:``, ``spares:``).

A run is a list of attempts, each an ordinary Job over the active nodes with the same job id, a
fresh run token and master port, and DDP_UP_ATTEMPT = its number in every process. Between two,
every node of the failed one has stopped (the Job's own cleanup), and the run waits
``restart_delay`` times the attempt number: a node that needs a minute to come back gets it.

The Roster (pure) says which listed nodes run, which wait as spares, and which are out. With
``spares:`` (or ``min_nodes:``), a node that is an attempt's root cause and was lost (its agent
unreachable or silent) is away until it answers again; one lost a second time, or the root cause
for the second time, is quarantined for the rest of the run. The next spare takes its place, the
same node rank with the same ranks, so the world size stays. Without a spare left, the run goes
on with fewer nodes only as far as ``min_nodes`` allows (the world size shrinks, and it says so);
else it ends with the failure. With neither setting, every attempt runs on the nodes listed (a
lost node may well be back). The away nodes are asked at the restarts after (Restarts.ask_away,
during the delay); one that answers rejoins while the run is smaller than it started, else it
waits as a spare (Roster.rejoin).

A later attempt preflights again only where needed: a node whose preflight passed before and that
was not lost since is "vetted" (vetted_after), and its agent skips the torch probe; a spare that
joins, or a node that was lost, gets the whole preflight.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable

from ..config.cluster import ClusterConfig, NodeConfig, never
from ..diagnose.outcome import JobResult, NodeStatus
from ..diagnose.preflight import TORCH_FIELDS
from ..errors import EXIT_SETUP, DdpUpError, NodeProblem
from ..job.events import Reshape
from ..job.reports import SLURM_CANCELLED
from ..node.protocol import policy
from ..plan.launch import Attempt, LaunchPlan
from .regrow import Asking, Prober, Watch, cut
from .roster import Roster, Verdict


@dataclass(frozen=True)
class AttemptRecord:
    """One attempt, as summary.json and the final summary show it."""

    number: int
    started: float  # wall clock
    ended: float
    nodes: tuple[str, ...]
    world_size: int
    exit_code: int
    root_cause: str | None
    end: str = "failed"  # why it ended: one of ENDS
    signature: str | None = None  # how it failed, numbers left out (crash_loop compares them)
    next: str | None = None  # what came after it: "restart 1 of 3", "recovery 1 of 3", or why nothing did
    went: float | None = None  # wall clock of its Go: how long it ran counts from there (crash_loop)
    out: tuple[str, ...] = ()  # the listed nodes out of the run while it ran (away or for good)

    def as_dict(self, iso) -> dict:
        return {"attempt": self.number, "started": iso(self.started), "ended": iso(self.ended),
                "nodes": list(self.nodes), "world_size": self.world_size, "exit_code": self.exit_code,
                "out": list(self.out), "end": self.end, "root_cause": self.root_cause, "next": self.next}


ENDS = ("succeeded", "failed", "hung", "lost", "stopped from outside", "could not start", "stopped", "stopped to grow",
        "stopped to set a node aside")
RESHAPED = ENDS[-2:]  # the run stopped the job to change its nodes: no failure
KIND_END = {"own": "failed", "hung": "hung", "lost": "lost", "outside": "stopped from outside"}
DEFAULT_RECOVERIES = 3


def recovery_limit(config: ClusterConfig, restarts: int) -> int:
    """`recoveries:`, else DEFAULT_RECOVERIES where the run restarts at all (`restarts:`, a spare
    or min_nodes set), else none: a run nobody asked to restart is never started again."""
    if config.recoveries is not None:
        return config.recoveries
    return DEFAULT_RECOVERIES if restarts or config.spares or config.min_nodes is not None else 0


def attempt_end(result: JobResult, cause: tuple[str | None, bool], could_not_start: bool = False,
                reshape: Reshape | None = None) -> str:
    """Why an attempt ended (one of ENDS); ``reshape``: the run stopped it to change its nodes (a
    rank that failed by itself meanwhile is still a failure, and one that ended well a success)."""
    if result.interrupted:
        return "stopped"
    if result.exit_code == 0:
        return "succeeded"
    if could_not_start:
        return "could not start"
    root = result.root_cause
    if root is None:
        return reshape.end if reshape is not None and not cause[1] else "lost" if cause[1] else "failed"
    return KIND_END[root.kind]


def failure_signature(result: JobResult) -> str | None:
    """The job's own failure with its numbers left out (policy.failure_signature)."""
    root = result.root_cause
    if root is None or root.kind != "own":
        return None
    return policy.failure_signature(root.exit_code, root.exception or root.what)


def slurm_ended(result: JobResult) -> str | None:
    """Why no attempt follows a stop that Slurm made (time limit, preemption, scancel): the
    allocation is ending, and Slurm's own requeue is what starts the job again."""
    root = result.root_cause
    if root is None or root.kind != "outside" or not root.what.startswith(SLURM_CANCELLED):
        return None
    return "Slurm is ending the allocation: no new attempt in it (sbatch --requeue has Slurm start the job again)"


def crash_loop(records: list[AttemptRecord]) -> str | None:
    """Why the run stops restarting before `restarts:` runs out (policy.crash_loop), or None."""
    return policy.crash_loop(ran(records))


def ran(records: list[AttemptRecord]) -> list[tuple[int, str | None, float]]:
    """The attempts as the restart decision takes them: (number, signature, seconds it ran)."""
    return [(r.number, r.signature, r.ended - (r.went or r.started)) for r in records]


def attempt_record(plan: LaunchPlan, result: JobResult, started: float, cause: tuple[str | None, bool],
                   could_not_start: bool = False, went: float | None = None,
                   reshape: Reshape | None = None) -> AttemptRecord:
    """The record of attempt ``plan.attempt``, ended now (one that could not start: exit status 3);
    ``went``: when its Go went (a first attempt's preflight, with its imports, is not how far it got)."""
    root = result.root_cause
    end = attempt_end(result, cause, could_not_start, reshape)
    what = root.render() if root else (cause[0] and f"{cause[0]} {'could not start' if end == 'could not start' else 'lost'}")
    why = next((n.reason for n in result.nodes if n.plan.label == cause[0] and n.state == "lost" and n.reason), None)
    if what and not root and why and end != "could not start":  # a node lost with no failure of its own: why
        what = f"{what} ({why})"
    return AttemptRecord(plan.attempt, started, time.time(), tuple(n.label for n in plan.nodes), plan.world_size,
                         result.exit_code if end != "could not start" else EXIT_SETUP,
                         plan.mask(what) if what else None, end, failure_signature(result), went=went,
                         out=tuple(plan.quarantined))


def blame(result: JobResult) -> tuple[str | None, bool]:
    """(the root cause's node label, whether that node was lost) of a failed attempt."""
    cause = result.root_cause
    if cause is None:
        lost = [n for n in result.nodes if n.state == "lost"]
        return (lost[0].plan.label, True) if lost else (None, False)
    return cause.label, any(n.plan.label == cause.label and n.state == "lost" for n in result.nodes)


def lost_in(result: JobResult) -> tuple[str, ...]:
    """The labels of the nodes an attempt lost or could not reach, in node order (the root
    cause's among them or not)."""
    return tuple(n.plan.label for n in result.nodes if n.state in ("lost", "error"))


def blame_setup(problems: list[NodeProblem]) -> tuple[str | None, bool]:
    """A later attempt whose preflight failed (a spare not fit to run): its first named node,
    treated as lost (it never ran; another try there would fail the same way)."""
    return (problems[0].node, True) if problems else (None, False)


def vetted_after(earlier: dict[str, dict], statuses: list[NodeStatus]) -> dict[str, dict]:
    """The nodes vetted for the next attempt: those that reported their torch build in this one
    (or were vetted before it: NodeReports.ready keeps the earlier word) and were not lost or unfit in it."""
    vetted = {label: facts for label, facts in earlier.items()
              if not any(s.plan.label == label and s.state in ("lost", "error") for s in statuses)}
    for s in statuses:
        if s.info.get("torch") and s.state not in ("lost", "error"):
            vetted[s.plan.label] = {key: s.info.get(key) for key in TORCH_FIELDS}
    return vetted


def delay_before(attempt: int, base: float) -> float:
    """Seconds to wait before ``attempt`` (1, 2, ...), as a detached job's supervisor waits too."""
    return policy.restart_delay(attempt, base)


def wait_for_signal(inbox, seconds: float) -> int | None:
    """Sleep ``seconds`` unless a signal arrives; the run's first signal if there was one (any
    signal ends a run for good, also one that came between two attempts)."""
    woke = threading.Event()
    with inbox.waking(woke.set):
        if not inbox.received:
            woke.wait(seconds)
    return inbox.first


@dataclass(frozen=True)
class NextAttempt:
    """What follows a failed attempt: the next one's cluster (None: the run ends here), why (its
    record's ``next``), and what to say about the nodes (a spare joins, a node is out)."""

    cluster: ClusterConfig | None
    why: str
    notice: str | None = None
    at_once: bool = False  # no restart delay: nothing failed that time mends (a master port taken)


@dataclass
class Restarts:
    """What the run loop needs to start the next attempt: the cluster as listed, who is where,
    how many new attempts each budget allows and has used, and how to plan an attempt (the same
    job, script and settings; a fresh run token)."""

    config: ClusterConfig
    roster: Roster
    limit: int  # `restarts:`: new attempts after the job's own failures
    delay: float
    planner: Callable[[ClusterConfig, Attempt], LaunchPlan] | None = None  # the run's make_plan for an attempt
    vetted: dict[str, dict] = field(default_factory=dict)  # see vetted_after
    recoveries: int = 0  # new attempts after a node lost or an outside stop (recovery_limit)
    used: Counter = field(default_factory=Counter)  # {"restart": n, "recovery": m}
    prober: Prober | None = None  # the labels of those nodes that answer (remote/detect)
    lister: Callable[[ClusterConfig], ClusterConfig] | None = None  # `nodes_command:`: the cluster as listed now
    watches: list[Watch] = field(default_factory=list)  # watch_away's, one an attempt that had one
    rejoin_after: float = 600.0  # `rejoin_after:`: how long an away node answers before a running job stops to take it back
    said_unfit: set[tuple[str, str]] = field(default_factory=set)  # (node, problem) said by unfit

    @classmethod
    def of(cls, config: ClusterConfig, limit: int | None = None,
           planner: Callable[[ClusterConfig, Attempt], LaunchPlan] | None = None,
           prober: Prober | None = None,
           lister: Callable[[ClusterConfig], ClusterConfig] | None = None) -> Restarts:
        limit = config.restarts if limit is None else limit
        return cls(config, Roster.of(config), limit, config.restart_delay, planner,
                   recoveries=recovery_limit(config, limit), prober=prober,
                   rejoin_after=config.rejoin_after, lister=lister)

    @property
    def any(self) -> bool:
        """Whether a run may ever have a second attempt."""
        return bool(self.limit or self.recoveries)

    def cluster(self) -> ClusterConfig:
        """The next attempt's cluster as the roster stands (the first attempt's, at first)."""
        return self.roster.cluster(self.config)

    def ask_away(self) -> Asking | None:
        """The nodes away from the run asked whether they answer again, on a thread of its own
        (while the run waits its restart delay); None where none is. A node lost in the attempt
        that just ended is not asked yet: it did not answer a moment ago, and asking would hold
        the smaller run's start for a connect timeout; the restart after asks it."""
        asked = [n for n in self.roster.away if n.label not in self.roster.just_lost]
        if not asked or self.prober is None:
            return None
        return Asking(self.prober, asked)

    def welcome(self, asking: Asking | None) -> list[str]:
        """The away nodes that answered come back (Roster.rejoin); what to say of each, and of
        those that answer but cannot run (unfit)."""
        if asking is None or not asking.done.is_set():
            return self.unfit()
        return self.roster.rejoin(asking.found, self.config.nodes) + self.unfit()

    def welcome_asked(self, ask: Reshape | None, result: JobResult) -> list[str]:
        """An attempt stopped to take nodes back that ended otherwise (a node lost, a rank failed in
        the stop, its ``result``): the nodes that answered come back all the same, before the next
        attempt is decided (Roster.rejoin; the count without the nodes it lost). What to say of each."""
        if ask is None or not ask.join:
            return []
        return self.roster.rejoin(set(ask.join), self.config.nodes, leaving=lost_in(result))

    def unfit(self) -> list[str]:
        """The away nodes that answer again but cannot run there (their python gone, a failing
        `setup:`), each said once a problem: why they stay out, and the fix."""
        found = getattr(self.prober, "unfit", {})
        said = []
        for node in self.roster.away:
            problem = found.get(node.label)
            if problem is not None and (node.label, problem.what) not in self.said_unfit:
                self.said_unfit.add((node.label, problem.what))
                said.append(f"{node.label} answers again but cannot rejoin: {problem.what}" +
                            (f" (fix: {problem.fix})" if problem.fix else ""))
        return said

    def relist(self) -> Verdict:
        """Before an attempt, with `nodes_command:`: the nodes it lists now (Roster.relist). A
        program that fails, or prints no valid list, changes nothing: the run keeps its last good
        list, and says why."""
        if self.lister is None:
            return Verdict(True)
        try:
            listed = self.lister(self.config)
        except DdpUpError as e:
            return Verdict(True, f"{e.render()}; the run keeps its last good node list")
        self.config = replace(self.config, nodes=listed.nodes)
        return self.roster.relist(listed.nodes)

    def watch_away(self, ready: Callable[[set[str]], None]) -> Watch | None:
        """While an attempt runs smaller than the run started: the nodes that could join watched
        in the background (regrow.Watch: the away ones, and with `nodes_command:` those it lists
        for the first time), ``ready`` called with those that answered for rejoin_after. None
        where there is nothing to grow back to, or with `rejoin_after: never`."""
        roster = self.roster
        if self.prober is None or never(self.rejoin_after) or len(roster.active) >= roster.size or \
                not (roster.away or self.lister):
            return None
        self.watches.append(Watch(self.prober, lambda: list(roster.away) + self.newly_listed(), self.rejoin_after,
                                  ready))
        return self.watches[-1]

    def newly_listed(self) -> list[NodeConfig]:
        """With `nodes_command:` (run now, from the watch's thread; the roster is only read): the
        nodes it lists that the run has not seen."""
        if self.lister is None:
            return []
        seen = {n.label for n in (*self.roster.active, *self.roster.spares, *self.roster.away)} | \
            set(self.roster.quarantined)
        return [n for n in self.lister(self.config).nodes if n.label not in seen]

    def close(self) -> None:
        """The run ends: the asks under way are cut short (their ssh processes end), and each
        watch's thread is waited for, bounded."""
        cut(self.prober)
        for watch in self.watches:
            watch.join()

    def reshape(self, ask: Reshape, attempt: int) -> tuple[LaunchPlan | None, list[str], str]:
        """After an attempt stopped to change its nodes (job/events.Reshape): the nodes that answer
        again rejoin (or, newly listed by `nodes_command:`, join), or the straggler is set aside,
        and attempt ``attempt`` starts at once, on no budget of restarts (the job did not fail).
        (Its plan, what to say, why for the record); None: no attempt can follow (the program
        lists fewer than min_nodes now)."""
        away = {n.label for n in self.roster.away}
        if ask.aside is not None:
            verdict = self.roster.set_aside(ask.aside)
            said, go_on = [verdict.notice], verdict.go_on
        else:
            said, go_on = self.roster.rejoin(set(ask.join), self.config.nodes), True
        if not go_on:
            return None, said, said[-1]
        following, listed = self.following(attempt)
        said += listed
        if following is None:
            return None, said, said[-1]
        size, names = len(following.nodes), ", ".join(sorted(ask.join))
        why = (f"{ask.aside} set aside: {size} node(s)" if ask.aside else
               f"grown back to {size} node(s): {names} rejoined" if set(ask.join) <= away else
               f"grown to {size} node(s): {names} joined")
        return following, said, why

    def following(self, attempt: int) -> tuple[LaunchPlan | None, list[str]]:
        """Attempt ``attempt``'s plan on the roster as it stands, once `nodes_command:` is read
        again (relist); None where it lists fewer than min_nodes now. What to say of the list."""
        listed = self.relist()
        said = [listed.notice] if listed.notice else []
        return (self.plan(self.cluster(), attempt) if listed.go_on else None), said

    def plan(self, cluster: ClusterConfig, attempt: int) -> LaunchPlan:
        """Attempt ``attempt``'s plan on ``cluster``, naming the nodes out of the run so far."""
        evict_after = self.config.evict_after if self.roster.can_spare else None
        return self.planner(cluster, Attempt(attempt, self.roster.out, evict_after, dict(self.vetted)))

    def vet(self, statuses: list[NodeStatus]) -> None:
        """After an attempt: remember which nodes need no torch probe in the next one."""
        self.vetted = vetted_after(self.vetted, statuses)

    def follows(self, result: JobResult) -> bool:
        """Whether an attempt may follow the failed one (its ``result``): restarts set, or its
        master port was taken (policy.port_taken), which ddp-up tries again by itself."""
        return self.any or self.port_taken(result)

    def port_taken(self, result: JobResult) -> bool:
        """Whether the attempt failed at its launcher's store, on a master port taken since its check."""
        root = result.root_cause
        return root is not None and root.kind == "own" and root.rank is None and policy.port_taken(root.exception) \
            and self.used["port"] < policy.PORT_RETRIES

    def unfixable(self, result: JobResult) -> str | None:
        """Why a failed attempt ends the run whatever restarts are left: its root cause exited
        with a code that `no_restart_on_exit:` lists (a usage error, a bad config: the same again)."""
        root = result.root_cause
        if root is None or root.kind != "own":
            return None
        return policy.unfixable_exit(root.exit_code, self.config.no_restart_on_exit, f"{root.label} rank {root.rank}")

    def after(self, result: JobResult, records: list[AttemptRecord], cause: tuple[str | None, bool]) -> NextAttempt:
        """After the failed attempt ``records[-1]`` (its ``result``, and what to blame): the next
        (policy.next_attempt decides; the roster then says on which nodes)."""
        why = slurm_ended(result)
        if why:
            return NextAttempt(None, why)
        budget, why = policy.next_attempt(records[-1].end if records else "failed", ran(records),
                                          {"restart": self.limit, "recovery": self.recoveries}, self.used,
                                          self.unfixable(result), port=self.port_taken(result))
        if budget is None:
            return NextAttempt(None, why)
        if budget == "port":  # no node's fault: the same nodes, a fresh port
            self.used[budget] += 1
            return NextAttempt(self.roster.cluster(self.config), why, at_once=True)
        verdict = self.roster.settle(*cause, also_lost=lost_in(result))
        if not verdict.go_on:
            return NextAttempt(None, verdict.notice, verdict.notice)
        self.used[budget] += 1
        return NextAttempt(self.roster.cluster(self.config), why, verdict.notice)
