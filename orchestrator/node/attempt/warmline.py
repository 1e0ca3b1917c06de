"""A node's warm interpreters, as its run has them (run mode, attached or detached): made as the
preflight begins (warm_interpreters: this node's WarmLine, or the Python session's KeptLine),
waited for at most READY_WAIT (await_warm), their notices held until the preflight passed
(HeldFrames), and ended with the job (end_warm).
"""

import os
import sys
import threading

from ..launchers.keptbox import BoxWarm, HeldHere, keeps_box
from ..launchers.keptwarm import KeptWarm
from ..launchers.warm import READY_WAIT, Warm, attempt_files
from ..local.procs import TAGS, TAG_ATTEMPT, spec_tags
from ..protocol import events, policy, wire
from .placement import TERMINAL_ENV, own_vars, warm_here

REAP_WAIT = 5.0  # seconds the agent waits, at its end, for its warm interpreter's exit after a SIGKILL


def await_warm(runner):
    """The wait for the warm interpreter's imports (begun as the preflight began, going on while the
    controller readies the other nodes), at most READY_WAIT; then the ranks start cold
    (Forker.usable). Attached, after the Go: Ready says the preflight passed, so a node that
    failed its preflight stops the others at once. Detached (runner.warm_before_ready), before
    Ready: every node's ranks start together, and ddp-up lets go of a job that runs everywhere.
    None, or the Stop that came meanwhile. Events are taken as in any phase (runner.next_event):
    heartbeats go on, probes and stack dumps are answered."""
    first = runner.warm and runner.warm.first
    if first is None:
        return None
    threading.Thread(target=lambda: first.answered(READY_WAIT) and runner.events.put(events.WarmAnswered()),
                     name="warm-wait", daemon=True).start()
    deadline = runner.clock() + READY_WAIT
    while runner.clock() < deadline:
        event = runner.next_event(deadline)
        if isinstance(event, events.WarmAnswered):
            return None
        if isinstance(event, events.Stop):
            return event
    first.patience = 0  # too long: the ranks start cold, and the interpreter is ended (Forker.usable)
    return None


class WarmLine:
    """A node's warm interpreter (warm.Warm), made as its preflight begins, importing while the
    preflight runs and the controller readies the other nodes. Attached, an agent runs one attempt: it has one (a
    restart's comes from the session's kept interpreters: run/kept.py). Detached, the agent runs
    every attempt, and one interpreter forks them all (``lasting``): a restart's ranks come from
    the interpreter that imported before the job began, never from one still importing. If that
    one has ended (its imports gave up, or it died), the next attempt makes another."""

    def __init__(self, make, attempt, lasting):
        self.make, self.lasting = make, lasting  # make(attempt) -> warm.Warm or None
        self.first = self.current = make(attempt)  # the one the node waits for (await_warm)

    def take(self, attempt):
        """Attempt ``attempt``'s interpreter (None: it starts cold)."""
        if self.lasting and self.current is not None and self.current.proc.poll() is not None:
            self.current = self.make(attempt)  # it ended: another, ready for this attempt or the next
        return self.current


class HeldFrames:
    """A writer's ``send`` that holds what it is given until ``release``, then passes it on."""

    def __init__(self, out):
        self.out, self.held, self.lock = out, [], threading.Lock()

    def send(self, frame, block=True):
        with self.lock:
            if self.held is not None:
                self.held.append(frame)
                return
        self.out.send(frame, block)

    def release(self):
        with self.lock:
            held, self.held = self.held, None
        for frame in held or ():
            self.out.send(frame)


def made_by(line):
    """The warm interpreters ``line`` (a WarmLine) started: its first, and the current attempt's."""
    return (line.first, line.current) if isinstance(line, WarmLine) else ()


def hush_warm(line, lasting_too=False):
    """The attempt ends here (``lasting_too``: the job): a warm interpreter still importing is
    killed with it, which is no news (not "the ranks start cold": none will start). A lasting one
    forks the next attempt's ranks: only the job's end hushes it."""
    for warm in made_by(line):
        if isinstance(warm, Warm) and warm.hello is None and (lasting_too or not warm.lasting):
            warm.late = True


def end_warm(line):
    """The job is over on this node (or never began: a failed preflight, a Stop before the Go):
    every warm interpreter this agent started is killed if still there, and waited for, before
    its state directory goes. It would die with this agent all the same, but then as a zombie
    under a PID 1 that does not reap (a container started without an init, whose first process
    is a notebook server, say): one a node for every job."""
    hush_warm(line, lasting_too=True)
    for warm in {id(w): w for w in made_by(line) if isinstance(w, (Warm, HeldHere))}.values():
        warm.reap(REAP_WAIT)


class KeptLine:
    """The Python session's kept interpreter (node/attempt/keep.py), the same for every attempt."""

    def __init__(self, kept):
        self.kept = self.first = kept

    def take(self, attempt):
        return self.kept


def warm_interpreters(spec, attempt, job_env, state_dir, out):
    """Warm start (the spec says where: plan.launch.warms): the WarmLine of this node, or the
    session's KeptLine; None for a cold start. Its imports are waited for in await_warm."""
    lasting = policy.runs_every_attempt(spec)
    if not warm_here(spec) or (spec.container and not ((spec.keep or lasting) and keeps_box(spec.container))):
        return None  # in a container, the interpreter is the image's: the attempt's own container's (boxwarm.py)
    report = lambda text: out.send(wire.Output("err", None, text.encode()))  # noqa: E731
    if spec.keep:  # the session's, on the host or in its kept container (keptbox.py)
        return KeptLine((BoxWarm if spec.container else KeptWarm)(spec.keep, report))
    return WarmLine(lambda n: warm_interpreter(spec, n, job_env, state_dir, report, lasting), attempt, lasting)


def warm_interpreter(spec, attempt, job_env, state_dir, report, lasting=False):
    """A warm interpreter made for attempt ``attempt``, or None where it cannot start (a cold
    start). ``lasting``: it forks every later attempt too (WarmLine), and so carries the job's
    tags less the attempt's: an attempt's end kills what carries its own (launch.Launch.end), the
    job's end and ddp-kill what carries the job's."""
    env = dict(TERMINAL_ENV, **job_env)  # as its ranks' (launch.launch_env), less the Go's
    env.update(spec_tags(spec, attempt))  # ddp-kill and the sweeps find it, and its ranks
    if lasting:  # (the agent's own environment carries its first attempt's too)
        env.pop(TAG_ATTEMPT)
    sock, log = attempt_files(state_dir, attempt)
    try:  # its socket for torchrun's stand-ins (userpython/standin.py)
        if spec.container:  # detached, restarts: in the container this agent keeps (keptbox.py)
            return HeldHere(spec, {k: env[k] for k in TAGS if k in env}, env, own_vars(spec, {}), report)
        return Warm(sys.executable, env, os.getcwd(), log, spec.preload or (), listen=sock, report=report,
                    nproc=spec.nproc or 1, lasting=lasting)
    except OSError as e:
        report("ddp-up: warm start: %s; the ranks start cold\n" % e)
        return None
