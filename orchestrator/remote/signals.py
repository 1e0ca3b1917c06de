"""Signals are events: a handler only records them, and the code acts at points of its choosing.

Raising from a handler lands an exception between any two statements (a second Ctrl-C between
``except`` and ``try`` once escaped the stop path and misreported the job). Instead, SIGINT,
SIGTERM and SIGHUP are appended to one inbox; loops wake up (a waker puts an event on their
queue) and read the inbox where it is safe: the job loop at each turn, start-up between steps,
parallel calls while they wait. The first signal asks for a graceful stop, the second for a kill;
the exit status is 128 + the first signal's number.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Callable, Iterator

from ..errors import Interrupted
from ..node.protocol.policy import NOT_A_STOP

HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
PASSED_ON = NOT_A_STOP  # not a stop: a running job passes them on to every rank


class SignalInbox:
    def __init__(self) -> None:
        self.received: list[int] = []  # in arrival order; only ever appended to
        self.passed_on: list[int] = []  # SIGUSR1/SIGUSR2, for the job's ranks: never a stop, never Interrupted
        self._wakers: list[Callable[[], None]] = []
        self._previous: dict[int, object] = {}

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def install(self) -> None:
        """Record the handled signals from now on (main thread only, as Python requires)."""
        if not self.installed and threading.current_thread() is threading.main_thread():
            for sig in HANDLED:
                self._previous[sig] = signal.signal(sig, self._record)
            for sig in PASSED_ON:
                self._previous[sig] = signal.signal(sig, self._pass_on)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _record(self, signum: int, _frame) -> None:
        # Only appends and wakes: list.append and SimpleQueue.put are safe in a handler.
        self.received.append(signum)
        for wake in list(self._wakers):
            wake()

    def _pass_on(self, signum: int, _frame) -> None:
        self.passed_on.append(signum)
        for wake in list(self._wakers):
            wake()

    def post(self, signum: int) -> None:
        """An event that ends what runs as that signal would (a reader's stdout gone: SIGPIPE)."""
        self._record(signum, None)

    @property
    def first(self) -> int | None:
        return self.received[0] if self.received else None

    def check(self) -> None:
        """A defined point in a step that has no job to stop yet: any signal so far ends it here."""
        if self.received:
            raise Interrupted(self.received[0])

    @contextmanager
    def waking(self, wake: Callable[[], None]) -> Iterator[None]:
        """Call ``wake`` from the handler while inside (it must be signal-safe: SimpleQueue.put)."""
        self._wakers.append(wake)
        try:
            yield
        finally:
            self._wakers.remove(wake)


INBOX = SignalInbox()  # the process's one inbox: the console entry points install it first thing


@contextmanager
def recording(inbox: SignalInbox = INBOX) -> Iterator[SignalInbox]:
    """The inbox, installed for the duration if nobody installed it before (a library caller)."""
    if inbox.installed:
        yield inbox
        return
    inbox.install()
    try:
        yield inbox
    finally:
        inbox.uninstall()
