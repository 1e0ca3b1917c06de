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
import signal
import sys
import threading
import time

from ..launchers.container import box_for
from ..local.procs import TAG_JOB, TAG_NODE, TAG_RUN, job_env, signal_name
from ..local.state import killed_by_ddp_kill, remove_node_dir
from ..protocol import events, policy, wire
from . import checks
from .inbox import Inbox
from .launch import Launch, gpu_left, outcome, results_of
from .warmline import HeldFrames, await_warm, end_warm, hush_warm, warm_interpreters

LAUNCHER_MARGIN = 2.0  # after stop_grace, for the launcher to kill what is left itself, report and exit
STUCK_WAIT = 2.0  # at a stop for a node lost: seconds a rank's stop handler gets before a rank stuck in a collective ends


class Runner:
    """One node's run of the job, from its spec (a wire.RunSpec) to its exit status."""

    def __init__(self, spec, writer, clock=time.monotonic):
        self.spec, self.out, self.clock = spec, writer, clock
        self.match = {TAG_JOB: spec.job, TAG_NODE: str(spec.node), TAG_RUN: spec.run}  # this launch only
        self.inbox = Inbox(self, clock)  # every event it acts on, taken in one place
        self.events = self.inbox.queue
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
        return events.Stop(policy.controller_silent_words(silent))

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
        problem, supervisor_port = preflight(self)
        if problem:
            return unstarted(self, problem, 3)
        self.warm_said.release()
        threading.Thread(target=events.read_controller, args=(sys.stdin.buffer, self.events.put, self.inbox.heard),
                         name="stdin", daemon=True).start()
        threading.Thread(target=heartbeats, args=(self.out, self.spec.heartbeat), name="heartbeat", daemon=True).start()
        event = ready_and_go(self, supervisor_port)
        if not isinstance(event, events.Go):
            return unstarted(self, wire.Exited(code=None, signal=None, stopped=True, reason=event.reason), 0)
        return self.run_job(event.frame)

    def job_env(self):
        return job_env(self.spec.env)

    # --- events: taken in one place (Inbox) -------------------------------------------------------

    def next_event(self, deadline=None):
        """The next event for the phase to act on, or None (Inbox.next)."""
        return self.inbox.next(deadline)

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
                return self.stop(event.reason, force=False, peer_lost=event.peer_lost)
            if isinstance(event, events.Stop):
                self.for_good = True
                by = ("ddp-kill" if killed_by_ddp_kill() else "signal") if event.signalled else None
                return self.stop("stopped by ddp-kill" if by == "ddp-kill" else event.reason, force=event.force, by=by,
                                 peer_lost=event.peer_lost)

    def start(self, go):
        """The attempt's launch, from ``go`` (its processes, relays and samplers: launch.py)."""
        self.before_start(go)
        self.launch = Launch(self.spec, self.out, self.match, self.dir, self.log_dir, self.attempt, self.job_env,
                             self.events.put, box_for(self.spec, self.attempt, self.dir, self.job_env()), self.torch)
        self.launch.start(go, self.warm and self.warm.take(self.attempt))

    # --- stopping and ending ----------------------------------------------------------------------

    def stop(self, reason, force, by=None, peer_lost=False):
        """stop_signal to the launcher (it gives every rank the same stop_grace: see launch.py), wait
        that and LAUNCHER_MARGIN, then SIGKILL every tagged survivor. A node where a rank died before
        the stop came lets its launcher end by itself first (REPORT_WAIT), with its report. For a
        node lost (``peer_lost``), the ranks stuck in a collective STUCK_WAIT later are ended then:
        it cannot complete without that node, and their stop handlers cannot run inside it."""
        hush_warm(self.warm)
        ended = None if force else before_stop(self.launch, self.next_event, self.clock, self.attempt)
        if ended is not None:
            return self.finish(ended[0], stopped=False, reason=ended[1])
        self.out.send(wire.Stopping(reason=reason, by=by, at=time.time()))
        code = None
        if not force:
            self.launch.signal(getattr(signal, self.spec.stop_signal, signal.SIGTERM))
            deadline = self.clock() + self.spec.stop_grace + LAUNCHER_MARGIN
            stuck_at = self.clock() + STUCK_WAIT if peer_lost else None
            while self.clock() < deadline:
                if stuck_at is not None and self.clock() >= stuck_at:
                    stuck_at = self.launch.end_stuck()
                event = self.next_event(min(deadline, stuck_at or deadline))
                if isinstance(event, events.Exited) and event.attempt == self.attempt:
                    code = event.code
                    self.launch.outlived(max(0.0, deadline - self.clock()))
                elif isinstance(event, events.RanksGone) and event.attempt == self.attempt:
                    break
                elif isinstance(event, events.Stop) and event.force:
                    force = True
                    break
                elif isinstance(event, events.Stop) and event.peer_lost and stuck_at is None:
                    stuck_at = self.clock()  # a node lost as this stop went on: its peers' collectives never end
        return self.finish(code, stopped=True, reason=reason, graceful=not force)

    def finish(self, code, stopped, reason, graceful=False):
        """The job's end here: what is left of it killed, every line relayed, then its Exited
        (``graceful``: a stop whose grace ran out for what it killed)."""
        hush_warm(self.warm)
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


def preflight(runner):
    """(None, the supervisor's port if any), or (the Failed frame that says what is wrong here
    and how to fix it, None)."""
    problem = checks.check_paths(runner.spec)
    if problem:
        return problem, None
    runner.dir, problem = checks.claim_state(runner.spec)
    if problem:
        return problem, None
    runner.log_dir = os.path.join(runner.dir, "logs")
    # it imports while the rest runs; a node that then fails says why, not also how its ranks start
    runner.warm = warm_interpreters(runner.spec, runner.attempt, runner.job_env(), runner.dir, runner.warm_said)
    box = box_for(runner.spec, runner.attempt, None, runner.job_env())
    runner.torch, problem = checks.versions(runner.spec, runner.job_env(), box, runner.out)
    if problem:
        return problem, None
    runner.held, problem = checks.hold_port(runner.spec)
    return (problem, None) if problem else (None, runner.prepare())


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


def install_handlers(on_stop):
    """The agent's signals: a stop (``on_stop`` records it), or policy.NOT_A_STOP (ignored: the
    ranks get those straight, from Slurm or from ddp-up through launch.py, never from the agent)."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, on_stop)
    for sig in policy.NOT_A_STOP:
        signal.signal(sig, signal.SIG_IGN)
