"""The detached job's decisions, as its supervisor makes them: pure functions of what it has heard
and of ``now`` (monotonic seconds; ``wall``: the wall clock, for records). The supervisor
(supervisor.py) does the I/O; its unit tests drive these in fake time.
"""

from ..local.state import ENDED
from ..protocol import policy
from ..watch import failures
from .members import RESHAPES

STOPPED_WAITING = "stopped for good while it waited to restart"  # a stop between attempts: the job is stopped


ENDS = {"failed": "failed", "hung": "hung", "stopped": "stopped from outside", "lost": "lost"}


def attempt_root(states, hung=None, halted=None):
    return attempt_summary(0, states, hung, halted, 0.0)["root_cause"]


def next_attempt(states, root, attempts, limits, used, listed, elastic=None):
    """What follows a detached job's attempt whose every node has ended, by policy.next_attempt
    (the rule ddp-up's restarts follow): (the budget the next attempt takes, its words), or (None,
    why none follows). Whatever the budgets: not after it succeeded, nor after someone stopped it for
    good (ddp-kill, a shutdown), nor with a node lost, unless the job is elastic (`min_nodes:`; the
    supervisor cannot reach a lost node to start it). ``root``: attempt_summary's root cause;
    ``attempts``: [(number, signature, seconds it ran)] before this one; ``listed``:
    no_restart_on_exit's codes; ``elastic``: (why the job cannot go on with the nodes left, or
    None; how the attempt was stopped to change its nodes: "grow", "aside", or None), for a job
    with `min_nodes:`. A job stopped to change its nodes starts again at once, and uses up no budget."""
    if all(st["state"] == "done" for st in states.values()):
        return None, "every node done"
    if any(st.get("final") for st in states.values()):
        return None, "stopped for good"
    lost = sorted(n for n, st in states.items() if st["state"] == "lost")
    if lost and elastic is None:
        return None, "node %d lost (a detached job restarts only on nodes its supervisor still hears; " \
                     "`min_nodes:` lets it go on without)" % lost[0]
    short, reshape = elastic or (None, None)
    if short:
        return None, short
    if reshape and (root or {}).get("state") == "stopped":
        return reshape, RESHAPES[reshape]
    end = ENDS.get((root or {}).get("state"), "failed")
    unfixable = None
    if end == "failed" and root.get("node") is not None:
        who = "node %s rank %s" % (root["node"], root["rank"]) if root.get("rank") is not None else "node %s" % root["node"]
        unfixable = policy.unfixable_exit(root.get("code"), listed or (), who)
    port = end == "failed" and root is not None and root.get("rank") is None and policy.port_taken(root.get("exception"))
    return policy.next_attempt(end, attempts, limits, used, unfixable, port)


class RestartBook:
    """A detached job's restarts, as its supervisor keeps them for next_attempt: the budgets, what
    each has given, and how every attempt so far failed and how long it ran (a crash loop)."""

    def __init__(self, spec, now):
        self.limits = {"restart": spec.restarts, "recovery": spec.recoveries}
        self.listed = tuple(spec.no_restart_on_exit or ())
        self.used, self.ran, self.began = {}, [], now  # new attempts by budget; (number, signature, seconds)
        self.budget, self.words, self.pending = None, None, []  # the last decision

    def decide(self, states, root, attempt, now, elastic=None):
        """next_attempt after ``attempt`` (every node has ended it), kept for begin."""
        self.pending = self.ran + [(attempt, signature(root), now - self.began)]
        self.budget, self.words = next_attempt(states, root, self.pending, self.limits, self.used, self.listed,
                                               elastic)
        return self.budget, self.words

    def started(self, now):
        """The first attempt's ranks start (its Go): how long it ran counts from here, as a restart's
        does, not from before its preflight (a warm start's first attempt imports torch there)."""
        self.began = now

    def begin(self, now):
        """The attempt decided on begins: its budget is used."""
        self.used[self.budget] = self.used.get(self.budget, 0) + 1
        self.ran, self.began = self.pending, now


def signature(root):
    """A detached attempt's failure, numbers left out (policy.failure_signature), or None: not the
    job's own failure (a hang, a stop from outside)."""
    if not root or root.get("state") != "failed":
        return None
    return policy.failure_signature(root.get("code"), root.get("exception") or root.get("reason") or "")


def lost_peers(now, peers, heard, states, limit):
    """(node, seconds silent) of every peer that has not ended and was not heard for ``limit``."""
    found = []
    for node in peers:
        silent = policy.silence(now, heard[node], limit)
        if silent is not None and states.get(node, {}).get("state") not in ENDED:
            found.append((node, silent))
    return found


class NodesProgress:
    """What each node last said of its ranks (Progress): how long they had been quiet, when it
    said so, which had not begun, and whether all had ended. ``own``: the same for the
    supervisor's node, read now."""

    def __init__(self):
        self.said = {}  # node -> (quiet seconds, when it said so, its ranks that have not begun, all ended)

    def quiet(self, nodes, now, heard, own):
        """{node: seconds since its ranks last printed}; one that never said counts from when it
        was heard. A node whose ranks have all ended is left out: its launcher finishing is no hang."""
        found = {}
        for node in nodes:
            quiet, at, _, ended = own.get(node) or self.said.get(node) or (0.0, heard[node], None, False)
            if not ended:
                found[node] = quiet + (now - at)
        return found

    def ended(self, nodes, own):
        """Whether some of ``nodes`` said that every rank of theirs has ended."""
        return any((own.get(node) or self.said.get(node) or (0, 0, None, False))[3] for node in nodes)

    def late(self, nodes, own):
        """The ranks of ``nodes`` that have not begun; None while one of them has not said which."""
        late = []
        for node in nodes:
            ranks = (own.get(node) or self.said.get(node) or (0, 0, None, False))[2]
            if ranks is None:
                return None
            late.extend(ranks)
        return late


def hang_step(now, timeout, hung, halted, quiet, first_done, startup=None, late=(), since_launch=0.0):
    """The hang watch at ``now`` (as ddp-up's HangWatch decides it): ("dump", why) when the job
    starts to look hung (every running rank prints its stack, into the journal, where an attach
    names the odd one out), ("halt", reason) policy.HANG_DUMP_WAIT after that, or None. ``hung``: (why,
    when) once declared; ``quiet``: {running node: seconds since its ranks last printed}. While
    ranks have not begun (``late``; None: not known yet), start-up's limit ``startup`` counts
    ``since_launch`` instead of the silence."""
    if not (timeout or startup) or halted is not None:
        return None
    if hung is not None:
        return ("halt", policy.hung_words(hung[0])) if now - hung[1] > policy.HANG_DUMP_WAIT else None
    if not quiet:
        return None
    if late is None or late:
        why = policy.startup_reason(since_launch, startup, late or ())
    else:
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
    if hung is not None and policy.is_hung(halted):
        first = {"node": None, "state": "hung", "code": None, "reason": halted, "at": wall}
    return {"attempt": attempt, "ended": wall, "root_cause": first, "halted": halted,
            "nodes": {str(n): st for n, st in states.items()}}
