"""Run mode, attached: preflight, wait for Go, start the launcher, relay, stop on request or silence.

The agent starts the launcher in its own session with the job's tags in its environment (for
``launcher: none`` it starts the workers itself: see workers.py), relays its output as frames,
and stops the whole job on this node when the controller asks, when the controller's connection
closes, or when the controller's heartbeat stops (the dead-man switch that covers network
partitions and sleeping laptops).

Every event the loop acts on (events.py) comes through one queue and is taken in one place,
``next_event``; the phases (waiting for Go, running, stopping) each act on the ones they care
about. A detached job's run (detached.DetachedRun) is this class with its hooks overridden: this
module never imports it.
"""

import os
import queue
import signal
import sys
import threading
import time

from . import checks, events, policy, wire
from .container import box_for
from .keptbox import BoxWarm, HeldHere, keeps_box
from .launch import TERMINAL_ENV, Launch, gpu_left, outcome, own_vars, results_of, warm_here
from .procs import TAG_ATTEMPT, TAG_JOB, TAG_NODE, TAG_RUN, TAGS, signal_name, spec_tags
from .state import killed_by_ddp_kill, remove_node_dir
from .warm import READY_WAIT, KeptWarm, Warm, attempt_files

LAUNCHER_MARGIN = 2.0  # after stop_grace, for the launcher to kill what is left itself, report and exit
REAP_WAIT = 5.0  # seconds the agent waits, at its end, for its warm interpreter's exit after a SIGKILL


class Runner:
    """One node's run of the job, from its spec (a wire.RunSpec) to its exit status."""

    def __init__(self, spec, writer, clock=time.monotonic):
        self.spec, self.out, self.clock = spec, writer, clock
        self.match = {TAG_JOB: spec.job, TAG_NODE: str(spec.node), TAG_RUN: spec.run}  # this launch only
        self.events = queue.SimpleQueue()  # put() is safe from signal handlers
        self.last_heard = clock()
        self.held = None  # the master port, held from preflight to Go (checks.PortHold)
        self.torch = None  # {"torch", "cuda", "nccl"} once probed
        self.dir = self.log_dir = self.warm = None  # state directory and logs, once claimed; a WarmLine if warm
        self.launch = None  # the current attempt's processes (launch.Launch), from Go on
        self.attempt = spec.attempt
        self.for_good = False  # no restart: a signal to this agent, the controller's Stop or silence; not a Halt
        self.warm_said = HeldFrames(writer)  # the warm interpreter's notices, sent once the preflight passed

    # --- hooks a detached run overrides ---------------------------------------------------------
    warm_before_ready = False  # where the node waits for its warm interpreter's imports (await_warm)

    def prepare(self):
        """After a passed preflight, before Ready: a detached run's supervisor listens. Its port."""
        return None

    def check_go(self, go):
        """None, or why this Go cannot be run (the job then stops)."""
        return None

    def before_start(self, go):
        """Before the launcher starts: a detached run opens the attempt's journal (and, first, its record)."""

    def run_job(self, go):
        """Start the job and watch it to its end here; the agent's exit status."""
        self.start(go)
        return self.supervise()

    def controller_gone(self, event):
        """The event a closed controller connection becomes (None: the job goes on)."""
        return events.Stop(event.reason)

    def controller_silent(self, silent):
        """The event a controller silent past orphan_timeout becomes (None: the job goes on)."""
        return events.Stop("no heartbeat from the controller for %.0f s" % silent)

    def after_exit(self, code, stopped, reason, failures, ends):
        """The job's end here has been reported (``failures``, ``ends``: its ranks', Exited's):
        True if another attempt starts here."""
        return False

    def keeps_logs(self):
        """Whether torchrun's log copy stays (the controller may have missed lines)."""
        return self.out.broken

    # --- the run ----------------------------------------------------------------------------------

    def on_signal(self, signum, _frame):
        self.for_good = True
        self.events.put(events.Stop("agent got " + signal.Signals(signum).name, signalled=True))

    def run(self):
        install_handlers(self.on_signal)
        problem, supervisor_port = self.preflight()
        if problem:
            return unstarted(self, problem, 3)
        self.warm_said.release()
        threading.Thread(target=events.read_controller, args=(sys.stdin.buffer, self.events.put, self.heard),
                         name="stdin", daemon=True).start()
        threading.Thread(target=heartbeats, args=(self.out, self.spec.heartbeat), name="heartbeat", daemon=True).start()
        event = ready_and_go(self, supervisor_port)
        if not isinstance(event, events.Go):
            return unstarted(self, wire.Exited(code=None, signal=None, stopped=True, reason=event.reason), 0)
        return self.run_job(event.frame)

    def preflight(self):
        """(None, the supervisor's port if any), or (the Failed frame that says what is wrong here
        and how to fix it, None)."""
        problem = checks.check_paths(self.spec)
        if problem:
            return problem, None
        self.dir, problem = checks.claim_state(self.spec)
        if problem:
            return problem, None
        self.log_dir = os.path.join(self.dir, "logs")
        # it imports while the rest runs; a node that then fails says why, not also how its ranks start
        self.warm = warm_interpreters(self.spec, self.attempt, self.job_env(), self.dir, self.warm_said)
        box = box_for(self.spec, self.attempt, None, self.job_env())
        self.torch, problem = checks.versions(self.spec, self.job_env(), box, self.out)
        if problem:
            return problem, None
        self.held, problem = checks.hold_port(self.spec)
        return (problem, None) if problem else (None, self.prepare())

    def job_env(self):
        return checks.job_env(self.spec.env)

    def heard(self):
        self.last_heard = self.clock()

    # --- events: taken in one place -------------------------------------------------------------

    def next_event(self, deadline=None):
        """The next event for the phase to act on, or None (a heartbeat went out, or an event was
        handled here): probes and stack dumps are answered in any phase, a controller gone or
        silent becomes what the run's hooks say."""
        wait = self.spec.heartbeat if deadline is None else max(0.0, min(self.spec.heartbeat, deadline - self.clock()))
        try:
            event = self.events.get(timeout=wait)
        except queue.Empty:
            return self.tick()
        if isinstance(event, events.Probe):
            threading.Thread(target=lambda: self.out.send(checks.probe(event.frame, self.job_env())),
                             daemon=True).start()
            return None
        if isinstance(event, (events.Dump, events.PassOn)):
            return self.launch and self.launch.answer(event)  # None: handled here
        if isinstance(event, events.ControllerGone):
            return self.controller_gone(event)
        return event

    def tick(self):
        """The controller's side of the heartbeat: the event a silent controller becomes, or None."""
        silent = policy.silence(self.clock(), self.last_heard, self.spec.orphan_timeout)
        return None if silent is None else self.controller_silent(silent)

    def wait_for_go(self):
        """Go, or the Stop that ends the job before it starts; the port is released either way."""
        while True:
            event = self.next_event()
            if isinstance(event, (events.Go, events.Stop)):
                self.close_listener()
                why = self.check_go(event.frame) if isinstance(event, events.Go) else None
                return events.Stop(why) if why else event

    def close_listener(self):
        if self.held is not None:
            self.held.close()
            self.held = None

    def supervise(self):
        """The job runs: until its launcher exits, or something stops it. Its exit status here."""
        while True:
            event = self.next_event()
            if isinstance(event, events.Exited) and event.attempt == self.attempt:
                return self.finish(event.code, stopped=False, reason=None)
            if isinstance(event, events.Halt) and event.attempt == self.attempt:  # the supervisor's
                return self.stop(event.reason, force=False)
            if isinstance(event, events.Stop):
                self.for_good = True
                by = ("ddp-kill" if killed_by_ddp_kill() else "signal") if event.signalled else None
                return self.stop("stopped by ddp-kill" if by == "ddp-kill" else event.reason, force=event.force, by=by)

    def start(self, go):
        """The attempt's launch, from ``go`` (its processes, relays and samplers: launch.py)."""
        self.before_start(go)
        self.launch = Launch(self.spec, self.out, self.match, self.dir, self.log_dir, self.attempt, self.job_env,
                             self.events.put, box_for(self.spec, self.attempt, self.dir, self.job_env()), self.torch)
        self.launch.start(go, self.warm and self.warm.take(self.attempt))

    # --- stopping and ending ----------------------------------------------------------------------

    def stop(self, reason, force, by=None):
        """stop_signal to the launcher (it gives every rank the same stop_grace: see launch.py), wait
        that and LAUNCHER_MARGIN, then SIGKILL every tagged survivor. A node where a rank died before
        the stop came lets its launcher end by itself first (REPORT_WAIT), with its report."""
        ended = None if force else before_stop(self.launch, self.next_event, self.clock, self.attempt)
        if ended is not None:
            return self.finish(ended[0], stopped=False, reason=ended[1])
        self.out.send(wire.Stopping(reason=reason, by=by, at=time.time()))
        code = None
        if not force:
            self.launch.signal(getattr(signal, self.spec.stop_signal, signal.SIGTERM))
            deadline = self.clock() + self.spec.stop_grace + LAUNCHER_MARGIN
            while self.clock() < deadline:
                event = self.next_event(deadline)
                if isinstance(event, events.Exited) and event.attempt == self.attempt:
                    code = event.code
                    self.launch.outlived(max(0.0, deadline - self.clock()))
                elif isinstance(event, events.RanksGone) and event.attempt == self.attempt:
                    break
                elif isinstance(event, events.Stop) and event.force:
                    force = True
                    break
        return self.finish(code, stopped=True, reason=reason, graceful=not force)

    def finish(self, code, stopped, reason, graceful=False):
        """The job's end here: what is left of it killed, every line relayed, then its Exited
        (``graceful``: a stop whose grace ran out for what it killed)."""
        code, reason, failures, ends = outcome(self.launch, code, stopped, reason)
        for result in results_of(self.launch):
            self.out.send(result)
        self.out.send(wire.Exited(code=code, signal=signal_name(code), stopped=stopped, reason=reason,
                                  gpu_left=gpu_left(self.launch.match), failures=failures, ends=ends,
                                  overran=self.launch.killed if graceful else None))
        if self.after_exit(code, stopped, reason, failures, ends):
            return 0  # the next attempt: same state directory, a journal and logs of its own
        end_warm(self.warm)
        self.out.drain(self.spec.orphan_timeout)
        remove_node_dir(self.dir, keep_logs=self.keeps_logs())  # torchrun's copy: lines the controller missed
        return 0


def unstarted(runner, frame, code):
    """The job never started on this node (a failed preflight, a Stop before the Go): ``frame``
    says so, once its warm interpreter and state directory are gone; ``code``, the agent's exit."""
    end_warm(runner.warm)
    remove_node_dir(runner.dir, keep_logs=False)
    runner.out.send(frame)
    runner.out.drain(5)
    return code


def ready_and_go(runner, supervisor_port):
    """Ready, then the Go (or the Stop that ends the job before it starts), with the wait for the
    warm interpreter's imports where the run has it (await_warm)."""
    event = await_warm(runner) if runner.warm_before_ready else None
    if event is None:
        runner.out.send(checks.ready(runner.spec, runner.torch, runner.job_env(), runner.held and runner.held.port,
                                     supervisor_port))
        event = runner.wait_for_go()
    if isinstance(event, events.Go) and not runner.warm_before_ready:  # the ranks wait for the imports
        event = await_warm(runner) or event
    return event


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


REPORT_WAIT = 2.0  # seconds a launcher whose rank died has, at a stop, to end by itself with its report
FINISHED = "every rank here had ended its script; its launcher, waiting at torchrun's exit barrier for a node " \
    "whose launcher had ended, was stopped"


def before_stop(launch, next_event, clock, attempt):
    """(exit code, reason) where this node's end needs no stop, else None: a rank died here before
    the stop came, and its launcher ends by itself with its report (own_end); or every rank here
    ended its script cleanly, and its launcher only waits at torchrun's exit barrier (nothing to
    save there, and nothing it would print, its traceback, is news): killed, and the node is done."""
    if launch.ranks_died():
        ended = own_end(next_event, clock, attempt)
        if ended is not None:
            return ended.code, None
    if launch.ranks_done():
        launch.signal(signal.SIGKILL)
        own_end(next_event, clock, attempt, wait=LAUNCHER_MARGIN)
        return 0, FINISHED
    return None


def own_end(next_event, clock, attempt, wait=REPORT_WAIT):
    """The Exited of ``attempt`` if its launcher ends by itself within ``wait`` seconds, else None.
    A rank of this node died (killed, the OOM killer) before the stop came: its launcher is about
    to say which, and when, in its failure report. Stopped first, it would not, and a peer's
    "connection reset" that reached the controller sooner would be taken for the root cause."""
    deadline = clock() + wait
    while clock() < deadline:
        event = next_event(deadline)
        if isinstance(event, events.Exited) and event.attempt == attempt:
            return event
        if isinstance(event, events.Stop) and event.force:
            return None
    return None


def heartbeats(out, every):
    """A heartbeat every ``every`` seconds, from a thread of its own: whatever the agent's loop waits
    on (a warm interpreter's fork, a slow client of its socket), the controller hears this node."""
    while True:
        time.sleep(every)
        out.send(wire.Heartbeat(), block=False)


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


def end_warm(line):
    """The job is over on this node (or never began: a failed preflight, a Stop before the Go):
    every warm interpreter this agent started is killed if still there, and waited for, before
    its state directory goes. It would die with this agent all the same, but then as a zombie
    under a PID 1 that does not reap (a container started without an init, whose first process
    is a notebook server, say): one a node for every job."""
    made = (line.first, line.current) if isinstance(line, WarmLine) else ()
    for warm in {id(w): w for w in made if isinstance(w, (Warm, HeldHere))}.values():
        warm.reap(REAP_WAIT)


class KeptLine:
    """The Python session's kept interpreter (node/keep.py), the same for every attempt."""

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
    try:  # its socket for torchrun's stand-ins (zygote.WARM_STUB)
        if spec.container:  # detached, restarts: in the container this agent keeps (keptbox.py)
            return HeldHere(spec, {k: env[k] for k in TAGS if k in env}, env, own_vars(spec, {}), report)
        return Warm(sys.executable, env, os.getcwd(), log, spec.preload or (), listen=sock, report=report,
                    nproc=spec.nproc or 1, lasting=lasting)
    except OSError as e:
        report("ddp-up: warm start: %s; the ranks start cold\n" % e)
        return None


def install_handlers(on_stop):
    """The agent's signals: a stop (``on_stop`` records it), or policy.NOT_A_STOP (ignored: the
    ranks get those straight, from Slurm or from ddp-up through launch.py, never from the agent)."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, on_stop)
    for sig in policy.NOT_A_STOP:
        signal.signal(sig, signal.SIG_IGN)
