"""A blocking call on every node at once, waited for in a way a signal can interrupt.

Daemon threads, not an executor: a call stuck on a dead host must not delay the process's exit
(an executor's threads are joined at exit). Each call bounds itself (connect timeout, answer
limits); the wait here adds the signal inbox: on SIGINT/SIGTERM/SIGHUP it aborts the calls and
raises Interrupted in the caller's thread, at this one point.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Sequence, TypeVar

from .signals import INBOX, SignalInbox

T = TypeVar("T")
R = TypeVar("R")
_WAKE = object()


def on_each(items: Sequence[T], call: Callable[[T], R], abort: Callable[[], None] | None = None,
            inbox: SignalInbox | None = INBOX, name: str = "call") -> list[R]:
    """``call(item)`` for every item at once; the results in order. A call's exception is raised
    here once all calls ended. With an ``inbox``, a signal (also one received before) calls
    ``abort`` and raises Interrupted without waiting for the calls."""
    if not items:
        return []
    done: queue.SimpleQueue = queue.SimpleQueue()
    results: list = [None] * len(items)
    errors: list[BaseException] = []

    def run(i: int, item: T) -> None:
        try:
            results[i] = call(item)
        except BaseException as e:  # noqa: BLE001 - surfaced on the caller's thread below
            errors.append(e)
        finally:
            done.put(i)

    for i, item in enumerate(items):
        threading.Thread(target=run, args=(i, item), name=f"{name}-{i}", daemon=True).start()
    left = len(items)
    if inbox is None:
        while left:
            done.get()
            left -= 1
    else:
        with inbox.waking(lambda: done.put(_WAKE)):
            while left:
                if inbox.received:
                    if abort is not None:
                        abort()
                    inbox.check()
                if done.get() is not _WAKE:
                    left -= 1
    if errors:
        raise errors[0]
    return results


def interruptible(step: Callable[[], R], abort: Callable[[], None] | None = None,
                  inbox: SignalInbox | None = INBOX) -> R:
    """``step()`` on a worker thread, waited for as ``on_each`` waits (a long local step, such as
    scanning a large tree, that a Ctrl-C must not have to sit through)."""
    return on_each([None], lambda _: step(), abort, inbox, name="step")[0]
