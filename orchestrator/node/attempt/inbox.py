"""The events a node's run acts on (protocol/events.py), taken in one place: the queue that signal
handlers and threads put on, the controller's heartbeat clock, and the next event a phase (waiting
for Go, running, stopping) is given. Probes and stack dumps are answered here in any phase; a
controller gone or silent becomes what the run's hooks say (run.Runner, detached.DetachedRun).
"""

import queue
import threading

from ..protocol import events, policy
from . import checks


class Inbox:
    """Run ``run``'s events (a Runner: its spec, writer, launch and hooks), in ``clock``'s time."""

    def __init__(self, run, clock):
        self.run, self.clock = run, clock
        self.queue = queue.SimpleQueue()  # put() is safe from signal handlers
        self.last_heard = clock()

    def heard(self):
        """The controller said something (a frame, a heartbeat)."""
        self.last_heard = self.clock()

    def next(self, deadline=None):
        """The next event for the phase to act on, or None (a heartbeat went out, or an event was
        handled here)."""
        run = self.run
        wait = run.spec.heartbeat if deadline is None else max(0.0, min(run.spec.heartbeat, deadline - self.clock()))
        try:
            event = self.queue.get(timeout=wait)
        except queue.Empty:
            return self.tick()
        if isinstance(event, events.Probe):
            threading.Thread(target=lambda: run.out.send(checks.probe(event.frame, run.job_env())),
                             daemon=True).start()
            return None
        if isinstance(event, (events.Dump, events.PassOn)):
            return run.launch and run.launch.answer(event)  # None: handled here
        if isinstance(event, events.ControllerGone):
            return run.controller_gone(event)
        return event

    def tick(self):
        """The controller's side of the heartbeat: the event a silent controller becomes, or None."""
        silent = policy.silence(self.clock(), self.last_heard, self.run.spec.orphan_timeout)
        return None if silent is None else self.run.controller_silent(silent)
