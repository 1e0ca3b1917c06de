"""The detached job's decisions, as its supervisor makes them: pure functions of what it has heard
and of ``now`` (monotonic seconds; ``wall``: the wall clock, for records). The supervisor
(supervisor.py) does the I/O; its unit tests drive these in fake time.
"""

from . import failures, policy
from .state import ENDED

STOPPED_WAITING = "stopped for good while it waited to restart"  # a stop between attempts: the job is stopped
HANG_DUMP_WAIT = 8.0  # after a detached job's ranks were asked for their stacks, before it is stopped


def why_not_restart(states, attempt, restarts):
    """Why a detached job whose every node has ended this attempt is not started again, or None:
    it succeeded, no restart is left, someone stopped it for good (ddp-kill, a shutdown), or a node
    is lost (the supervisor cannot reach it to start it, and nothing takes its place)."""
    if all(st["state"] == "done" for st in states.values()):
        return "every node done"
    limit = policy.why_no_restart(attempt, restarts)
    if limit:
        return limit
    if any(st.get("final") for st in states.values()):
        return "stopped for good"
    lost = sorted(n for n, st in states.items() if st["state"] == "lost")
    if lost:
        return "node %d lost (a detached job restarts only on nodes its supervisor still hears)" % lost[0]
    return None


def lost_peers(now, peers, heard, states, limit):
    """(node, seconds silent) of every peer that has not ended and was not heard for ``limit``."""
    found = []
    for node in peers:
        silent = policy.silence(now, heard[node], limit)
        if silent is not None and states.get(node, {}).get("state") not in ENDED:
            found.append((node, silent))
    return found


def hang_step(now, timeout, hung, halted, quiet, first_done):
    """The hang watch at ``now`` (as ddp-up's HangWatch decides it): ("dump", why) when the job
    starts to look hung (every running rank prints its stack, into the journal, where an attach
    names the odd one out), ("halt", reason) HANG_DUMP_WAIT after that, or None. ``hung``: (why,
    when) once declared; ``quiet``: {running node: seconds since its ranks last printed}."""
    if not timeout or halted is not None:
        return None
    if hung is not None:
        return ("halt", "job hung (%s)" % hung[0]) if now - hung[1] > HANG_DUMP_WAIT else None
    if not quiet:
        return None
    why = policy.hang_reason(now, now - min(quiet.values()), first_done, timeout, len(quiet))
    return ("dump", why) if why else None


def node_end(state, code, reason, final, failure, wall):
    """A node's end as the supervisor keeps it: {"state", "code", "reason", "final", "at",
    "rank", "exception"}. A failed node's own earliest rank failure (its NodeState.failure) gives
    the time and the exception; without one, ``wall``: when the supervisor heard of it."""
    end = {"state": state, "code": code, "reason": reason, "final": final, "at": wall, "rank": None,
           "exception": None}
    if state == "failed" and isinstance(failure, dict):
        at, rank, exception = failure.get("at"), failure.get("rank"), failure.get("exception")
        if isinstance(at, (int, float)) and not isinstance(at, bool) and at == at:
            end["at"] = float(at)
        end["rank"] = rank if isinstance(rank, int) and not isinstance(rank, bool) else None
        end["exception"] = exception[:failures.LINE_MOST] if isinstance(exception, str) else None
    return end


def describe_end(state, code, reason):
    if state == "failed":
        killed = isinstance(code, int) and code < 0
        return "failed (%s)" % (policy.exit_words(code) if killed else "exit code %s" % code)
    return "%s (%s)" % (state, reason) if reason else state


def attempt_summary(attempt, states, hung, halted, wall):
    """One attempt as outcome.json lists it: every node's end, and the root cause (the earliest
    failure, or the hang the supervisor stopped the job for)."""
    failures = [dict(st, node=n) for n, st in states.items() if st["state"] != "done"]
    first = policy.earliest(failures, lambda f: f["at"], exception=lambda f: f.get("exception"))
    if hung is not None and halted and halted.startswith("job hung"):
        first = {"node": None, "state": "hung", "code": None, "reason": halted, "at": wall}
    return {"attempt": attempt, "ended": wall, "root_cause": first, "halted": halted,
            "nodes": {str(n): st for n, st in states.items()}}
