"""The decisions both ends make, written once: the controller (attempts, hang, outcome, job)
imports this module, and it is shipped to every node with the agent, whose detached-job
supervisor makes the same decisions without a controller. Pure and stdlib-only: every function
takes the time it decides at (``now``, monotonic seconds unless it says wall clock).
"""

import re
import signal

# Signals that are no stop, anywhere: ddp-up passes them on to every rank (a Slurm warning, a
# checkpoint-now), and the agents ignore them, as do torchrun and every rank without a handler of
# its own (inherited): Slurm sends its warning (--signal=USR1@T) to every process of a step.
NOT_A_STOP = (signal.SIGUSR1, signal.SIGUSR2)


def exit_words(code, signal_name=None):
    """How a process ended, in words: ``exited with code 3``, ``was killed by SIGKILL`` (a
    negative code is Python's for a signal, as torchrun reports its workers)."""
    if signal_name:
        return "was killed by %s" % signal_name
    if isinstance(code, int) and code < 0:
        try:
            return "was killed by %s" % signal.Signals(-code).name
        except ValueError:
            return "was killed by signal %d" % -code
    return "exited with code %s" % code


# Why an attempt ended (summary.json's `end`), and the budget a new attempt after it uses: the
# job's own failures use up `restarts:`; a node lost or a stop from outside the job (Slurm's time
# limit or preemption, a shutdown, a signal that ddp-up did not send) use up `recoveries:`. After
# any other end ("succeeded", "stopped": someone wants the run over) nothing follows.
BUDGET = {"failed": "restart", "hung": "restart",
          "lost": "recovery", "stopped from outside": "recovery", "could not start": "recovery"}
CRASH_LOOP = 3  # this many attempts in a row failing the same way, none getting further: no more restarts
PROGRESS = 2.0  # an attempt that ran this many times as long as another of them (+ PROGRESS_SLACK) got further
PROGRESS_SLACK = 10.0  # seconds: the start of a job (connect, preflight, rendezvous) varies this much


# The master port taken between its check and the launcher's bind (another program named it): the
# launcher fails at its store, before any rank ran. The next attempt, on a fresh port, uses no budget.
PORT_RETRIES = 3  # such attempts in a run


def port_taken(launcher_exception):
    """Whether the launcher's own exception (not a rank's: a script may fail binding a port of its
    own) says its store could not listen: torchrun's DistNetworkError ... EADDRINUSE."""
    return bool(launcher_exception) and "EADDRINUSE" in launcher_exception


def next_attempt(end, attempts, limits, used, unfixable=None, port=False):
    """The restart decision, the same for ddp-up and a detached job's supervisor. After an attempt
    that ended as ``end`` (BUDGET's words), with ``attempts`` so far ([(number, failure signature
    or None, seconds it ran)], the last this one), ``limits`` and ``used`` ({"restart": n,
    "recovery": m}: allowed, and taken so far), and ``unfixable`` (why no restart can help, e.g.
    an exit code that no_restart_on_exit lists, or None): (the budget the next attempt takes,
    its words: "restart 1 of 3"), or (None, why nothing follows). ``port``: the attempt failed
    because its master port was taken (port_taken): again at once, on no budget, PORT_RETRIES times."""
    if port and end == "failed" and used.get("port", 0) < PORT_RETRIES:
        return "port", "the master port was taken before the launcher could listen on it: again on another " \
                       "port (%d of %d; restarts: untouched)" % (used.get("port", 0) + 1, PORT_RETRIES)
    why = unfixable or crash_loop(attempts)
    if why:
        return None, why
    budget = BUDGET.get(end)
    if budget is None:
        return None, "the attempt %s" % end
    limit, taken = limits.get(budget, 0), used.get(budget, 0)
    kind = "restarts" if budget == "restart" else "recoveries"
    if taken >= limit:
        return None, "no %s left (%s: %d)" % (budget, kind, limit) if limit else "no %s set" % kind
    counted = "" if budget == "restart" else " (not the job's own failure: restarts: untouched)"
    return budget, "%s %d of %d%s" % (budget, taken + 1, limit, counted)


def failure_signature(code, text):
    """How a job failed by itself, numbers left out ("exit 1: RuntimeError: CUDA out of memory.
    Tried to allocate # GiB"): two attempts with the same one failed the same way."""
    return re.sub(r"\d+", "#", "exit %s: %s" % (code, text))


def crash_loop(attempts):
    """Why restarts stop before they run out, or None: the last CRASH_LOOP attempts failed the same
    way, and none got much further than another (by how long it ran: a job that fails at step 10
    each time fails after about as long). One that ran PROGRESS times as long made progress (it
    may have failed later on in the data, or resumed from a checkpoint)."""
    last = attempts[-CRASH_LOOP:]
    if len(last) < CRASH_LOOP or last[0][1] is None or any(a[1] != last[0][1] for a in last):
        return None
    took = [a[2] for a in last]
    if max(took) > PROGRESS * min(took) + PROGRESS_SLACK:
        return None
    return ("crash loop: attempts %d to %d failed the same way, each within %.0f s of its start; no more "
            "restarts (the next would fail the same way): fix the cause and run again" % (
                last[0][0], last[-1][0], max(took)))


def unfixable_exit(code, listed, who):
    """Why a failure no restart can fix, or None: ``who`` (its rank) exited with a code that
    `no_restart_on_exit:` lists (a usage error, a bad config: the same again)."""
    if code is None or isinstance(code, bool) or code not in listed:
        return None
    return "%s exited with %s, which no_restart_on_exit lists: no restart" % (who, code)


BACKOFF_FIRST = 0.25  # the least wait before the first restart, whatever restart_delay says (0 too)
BACKOFF_MOST = 60.0  # the back-off doubles up to this


def restart_delay(attempt, base):
    """Seconds to wait before attempt ``attempt`` (1, 2, ...): base, 2x base, 3x base..., and never
    less than a back-off that doubles from BACKOFF_FIRST up to BACKOFF_MOST. A node that needs a
    minute to come back gets it, and with `restart_delay: 0` a job that fails at once is not
    started again in a tight loop."""
    return max(base * attempt, min(BACKOFF_FIRST * 2 ** min(attempt - 1, 16), BACKOFF_MOST))


def runs_every_attempt(job):
    """Whether each node's agent runs every attempt of ``job`` (a LaunchPlan, or the RunSpec made of
    it): a detached job that may start again, restarted by its own supervisor. One warm interpreter
    (or kept container) on the node then forks every attempt (node/attempt/run.py), and the plan ships
    that container's code (plan.launch.code_in_image)."""
    return bool(job.detach and job.restarts + job.recoveries)


def hang_reason(now, last_output, first_done, timeout, running):
    """Why a job looks hung at ``now``, or None: no line from any rank for ``timeout`` seconds
    (``last_output``: the latest line's time, or when the job started), or a node finished that
    long ago (``first_done``) while ``running`` nodes (a count) still run."""
    if not timeout or not running:
        return None
    quiet = now - last_output
    if quiet > timeout:
        return "no output from any rank for %.0f s" % quiet
    if first_done is not None and now - first_done > timeout:
        return "a node finished %.0f s ago, %d still running" % (now - first_done, running)
    return None


STARTUP_LEAST = 600.0  # start-up's limit unless `startup_timeout` says: at least this, or hang_timeout


def startup_limit(startup, timeout):
    """How long after the launch the ranks may take to begin (a line, or their process group up):
    ``startup_timeout`` where set, else the hang timeout but at least STARTUP_LEAST (importing
    torch on a loaded node, or from a venv on NFS, is no hang); None: start-up is not watched."""
    if startup is not None:
        return startup
    return max(timeout, STARTUP_LEAST) if timeout else None


def startup_reason(waited, limit, late):
    """Why a job that has not fully begun looks hung after ``waited`` seconds, or None: past
    start-up's ``limit``, ``late`` (the ranks that have not begun; empty: not known yet) are named."""
    if not limit or waited <= limit:
        return None
    return not_started(late, waited) if late else "not every rank began within %.0f s" % waited


def not_started(ranks, waited):
    """``rank 3 has not reached init_process_group after 600 s``."""
    return "%s %s not reached init_process_group after %.0f s" % (
        rank_list(ranks), "has" if len(set(ranks)) == 1 else "have", waited)


def rank_list(ranks):
    """'rank 5' or 'ranks 0-4, 6-7'."""
    ranks = sorted(set(ranks))
    runs = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(str(a) if a == b else "%d-%d" % (a, b) for a, b in runs)
    return ("rank %s" if len(ranks) == 1 else "ranks %s") % text


def node_end(ranks_failed, stopped, code):
    """How a node's part of a job ended, for the node's agent and ddp-up alike: "failed" when its
    ranks failed by themselves (before any stop, whatever the launcher then did), "stopped" when
    it ended because a stop was asked for, "done" on a 0, else "failed" (the launcher's own)."""
    if ranks_failed:
        return "failed"
    if stopped:
        return "stopped"
    return "done" if code == 0 else "failed"


HANG_DUMP_WAIT = 5.0  # after a hung job's ranks were asked for their stacks, before it is stopped (both ends)
HUNG = "job hung"


def hung_words(why):
    """The words a job stopped as hung is stopped with, from why it looks hung (kept as they are
    if they already say so): read back by is_hung, here and in a replay of a detached job."""
    return why if is_hung(why) else "%s (%s)" % (HUNG, why)


def is_hung(reason):
    """Whether a stop's reason is hung_words'."""
    return isinstance(reason, str) and reason.startswith(HUNG)


# A node agent that hears nothing from ddp-up for orphan_timeout stops its ranks (the controller may
# be gone); if its link comes back in time to say so, that node was lost for a while, not stopped
# by someone else: the controller reads the reason back (controller_lost).
CONTROLLER_SILENT = "no heartbeat from the controller for"


def controller_silent_words(silent):
    return "%s %.0f s" % (CONTROLLER_SILENT, silent)


def controller_lost(reason):
    """Whether a node's stop was its agent's, after hearing nothing from the controller."""
    return isinstance(reason, str) and reason.startswith(CONTROLLER_SILENT)


# A warm interpreter that died while the ranks it forked ran (the OOM killer, a kill by hand): their
# exit statuses went with it. The node's end says so, and a rank's failure then carries it.
WARM_DIED = "its warm interpreter "


def warm_died_words(pid, how):
    return "%s(pid %d) %s while its ranks ran: their exit statuses are lost" % (WARM_DIED, pid, how)


def warm_died(reason):
    return isinstance(reason, str) and reason.startswith(WARM_DIED)


def silence(now, heard, limit):
    """How long an end has been silent (``heard``: when it last was), if past ``limit`` (the
    orphan timeout: it then counts as lost, or gone), else None."""
    silent = now - heard
    return silent if silent > limit else None


# A rank's exception that says a peer went away (gloo's "Connection closed by peer", a reset
# socket, NCCL's "remote process exited"): what a rank meets when another rank died first, so
# never the root cause while a rank that raised on its own is near enough in time to be it.
PEER_LOST = re.compile(r"(connection (reset|closed) by peer|broken pipe|remote process exited|"
                       r"peer (closed|disconnected|hung up)|ECONNRESET|EPIPE)", re.I)
PEER_LOST_REACH = 10.0  # seconds after a peer-lost failure in which the failure that caused it is looked for


def peer_lost(exception):
    """Whether a rank's exception text says it lost a peer (bounded: the text is the job's)."""
    return bool(exception) and PEER_LOST.search(exception[:2000]) is not None


def earliest(failures, when, window=lambda failure: 0.0, exception=lambda failure: None, stopped=lambda failure: False):
    """The root cause: the failure that happened first, or None. ``when(failure)``: its time;
    ``window(failure)``: how much later it may really have been (torchrun's report says the
    second: 1.0; an error file's time is exact: 0); ``exception(failure)``: the rank's exception
    text, or None (a death by a signal). Every failure that may have happened as early as the
    first ties with it, and a tie goes to a rank's own exception, then to a death by a signal,
    then to a death by a stop signal (``stopped(failure)``: the SIGTERM torchrun sends the
    survivors of a failed rank), then to an exception that only says a peer went away: when one
    rank raises, gloo and NCCL abort or disconnect its peers. A first failure that says a peer went away reaches
    PEER_LOST_REACH seconds further for the failure that caused it (a log's time is its last
    write, which can come after the peer's own)."""
    if not failures:
        return None

    def order(f):
        text = exception(f)
        return (3 if peer_lost(text) else 0 if text else 2 if stopped(f) else 1), when(f)
    first = min(failures, key=when)
    reach = window(first) + (PEER_LOST_REACH if peer_lost(exception(first)) else 0.0)
    return min((f for f in failures if when(f) <= when(first) + reach), key=order)
