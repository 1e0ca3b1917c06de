"""The steps of a job's life that the loop takes one after the other, as values: how long to wait
for every node's Ready (ready_deadline, overdue), the checks across nodes (probe, cross_checks),
Go to every node at once (go_frames), and at the end, whose channels' last words to wait for
(settling). The loop (loop.py) turns until each step is done or its deadline passes.
"""

from __future__ import annotations

import os
import re
import shlex

from ..config.containers import preflight_allowance
from ..diagnose import gpuhealth, preflight
from ..errors import NodeProblem, SetupError
from ..node.protocol import policy, wire

SETUP_MARGIN = 30.0  # beyond connect_timeout for an agent to preflight and report ready
PROBE_MARGIN = 10.0  # beyond the probe's own timeout for every node to answer it
SETTLE = 2.0  # after the last node's end, for the channels to report theirs (their last stderr lines)


def ready_deadline(plan, now: float) -> float:
    """Until when the loop waits for every node's Ready: its connect, its preflight (in a container:
    the image's too), and a margin."""
    return now + SETUP_MARGIN + max(n.config.ssh.connect_timeout + preflight_allowance(n.config.container)
                                    for n in plan.nodes)


def first_word(plan, node) -> float:
    """How long a node's agent may be silent before its first frame, once its process exists: its
    start (the session over the connection, `setup:`, the interpreter and its modules) takes more
    than a heartbeat on a loaded node. A node that never speaks is overdue at the ready deadline."""
    return max(plan.orphan_timeout, node.config.ssh.connect_timeout + SETUP_MARGIN)


def listened(sessions, statuses, ended) -> list:
    """The (session, status) of every node whose agent is to be heard from now: started, neither
    ended nor ``ended`` (an attach: the nodes whose journal has been read to its end)."""
    return [(session, status) for session, status in zip(sessions, statuses)
            if not (status.terminal or not session.started or status.plan.index in ended)]


def silent(listening, plan, now: float) -> list[tuple[int, float]]:
    """Of ``listening`` (listened's), the nodes silent past their limit: orphan_timeout once the
    agent said something, its start's (first_word) before. (index, seconds silent)."""
    found = []
    for session, status in listening:
        limit = plan.orphan_timeout if session.heard else first_word(plan, status.plan)
        quiet = policy.silence(now, session.last_heard, limit)
        if quiet is not None:
            found.append((status.plan.index, quiet))
    return found


# A node whose ssh session has not logged in this long past its connect_timeout is not reached: a
# session over a shared connection whose link died (during a restart delay, say) would otherwise
# wait out the whole ready deadline. Generous: a login behind a jump host, or with slow DNS, is slow.
LOGIN_MARGIN = 10.0


def login_limit(node) -> float:
    """How long a node's ssh session may take to log in before the node is not reached."""
    return node.config.ssh.connect_timeout + LOGIN_MARGIN


def logging_in(session, status) -> bool:
    """Whether a node's ssh session runs and has not logged in yet (a transport that cannot tell: never)."""
    return status.state == "connecting" and getattr(session, "logged_in", None) is False and session.started


def unreached(sessions, statuses, now: float) -> list[tuple[int, NodeProblem]]:
    """The nodes still connecting whose session has not logged in past connect_timeout and
    LOGIN_MARGIN (a transport that cannot tell is never among them), each with its problem."""
    found = []
    for session, status in zip(sessions, statuses):
        if logging_in(session, status):
            problem = not_reached(status.plan, now - session.last_heard)
            if problem is not None:
                found.append((status.plan.index, problem))
    return found


# An attach names the nodes it still waits to log in to after this long, when the other nodes' lines
# are held for them (job/backlog.py): until then it shows nothing, and looks stuck.
HELD_SAID = 3.0


def held_back(following, sessions, statuses, now: float) -> str | None:
    """Once an attempt of an attach (``following``): the word on the nodes not logged in after
    HELD_SAID seconds while the others' lines wait for their journals, or None."""
    if following.told_held or not following.order.held:
        return None
    late = [status.plan for session, status in zip(sessions, statuses)
            if logging_in(session, status) and now - session.last_heard >= HELD_SAID]
    if not late:
        return None
    following.told_held = True
    names = ", ".join(node.label for node in late[:3]) + (f" and {len(late) - 3} more" if len(late) > 3 else "")
    limit = max(login_limit(node) for node in late)
    return (f"waiting for {names} to answer: the other nodes' lines are held until then, to be shown in time order "
            f"(a node that does not answer is given up on after {limit:g} s)")


def not_reached(node, silent: float) -> NodeProblem | None:
    """The problem of a node whose session has not logged in after ``silent`` seconds, or None."""
    if silent <= login_limit(node):
        return None
    return NodeProblem(node.label, f"not reached: its ssh session has not logged in after {silent:.0f} s "
                                   f"(connect_timeout {node.config.ssh.connect_timeout:g} s; its link or sshd is down?)",
                       f"check that `ssh {shlex.quote(node.config.host)} true` answers")


def overdue(statuses) -> list[tuple[int, NodeProblem]]:
    """The nodes still connecting at the deadline, each with its problem."""
    return [(s.plan.index, NodeProblem(s.plan.label, "no ready report from the node agent",
                                       "check the node's load and filesystem"))
            for s in statuses if s.state == "connecting"]


def probe(plan, master_port: int | None) -> wire.Probe:
    """What every node is asked before Go: a real TCP connection to the master's port."""
    return wire.Probe(addr=plan.master_addr, port=master_port, timeout=preflight.PROBE_TIMEOUT)


PROBE_WAIT = preflight.PROBE_TIMEOUT + PROBE_MARGIN  # for every node to answer the probe


def cross_checks(plan, statuses, master_port: int | None) -> tuple[list[NodeProblem], list[str]]:
    """Across nodes, once they answered the probe: the same torch as the master, enough GPUs, a real
    TCP path to the master. (the problems, the notices to show)"""
    busy, busy_notices = preflight.busy_gpus(statuses, plan.allow_busy_gpus)
    unhealthy, health_notices = gpuhealth.health_problems(statuses, plan.allow_unhealthy_gpus)
    problems = preflight.cross_node_problems(statuses, plan.master.index, f"{plan.master_addr}:{master_port}",
                                             busy + unhealthy)
    notices = preflight.skew_notices(statuses) + busy_notices + health_notices + \
        preflight.accelerate_notices(statuses, plan.script, plan.launcher, uses_accelerate(plan.script))
    return problems, notices + ([] if problems else preflight.interface_notices(statuses))


def go_frames(plan, statuses, master_port: int | None, supervisor_port: int | None) -> list[wire.Go]:
    """Every node's Go, in the nodes' order; SetupError if the master's agent did not say what the
    job needs of it."""
    if master_port is None:
        raise SetupError([NodeProblem(plan.master.label, "the master did not report a free port")])
    if plan.detach and supervisor_port is None:
        raise SetupError([NodeProblem(plan.master.label, "the master did not report its supervisor's port",
                                      "use the same ddp-up version everywhere")])
    supervisor = [plan.master_addr, supervisor_port] if plan.detach else None
    said = gpuhealth.said_of(statuses) if plan.detach and plan.evict_after is not None else None
    return [wire.Go(argv=plan.launcher_argv(status.plan, master_port), supervisor=supervisor,
                    env=preflight.interface_env(status) or None,
                    gpus_said=said if status.plan.index == plan.master.index else None) for status in statuses]


def settling(sessions, statuses) -> list[int]:
    """The nodes whose channels' own ends the loop waits for (within SETTLE) once every node has
    ended, so that what a channel's stderr said last is read before the result (Slurm's word on a
    step it cancelled). A lost node's channel was closed by the loop: not waited for."""
    return [i for i, (s, st) in enumerate(zip(sessions, statuses))
            if s.started and st.state in ("done", "failed", "stopped")]


ACCELERATE_IMPORT = re.compile(rb"^[ \t]*(from|import)[ \t]+accelerate\b", re.M)
SCRIPT_READ = 1 << 18  # bytes of a script read to see whether it uses Accelerate


def uses_accelerate(script: str) -> bool:
    """Whether the script, where it is readable here too (a synced or shared checkout), imports
    Accelerate: the start of a regular file, read bounded, never run."""
    try:
        with open(script, "rb") as f:
            return os.path.isfile(script) and ACCELERATE_IMPORT.search(f.read(SCRIPT_READ)) is not None
    except OSError:
        return False
