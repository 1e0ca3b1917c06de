"""One test session's worker at a time for a fixture that owns fixed machine resources.

A Slurm cluster (its subnet and ports) and the container runtimes (their daemons' sockets and
bridges) exist once per machine. pytest-xdist's `xdist_group` keeps each on one worker, but only
where pytest and pytest-xdist agree on how a group is marked (pytest 9.2 broke it for
pytest-xdist 3.8). This lock is the guarantee under the grouping: if the tests of one such
module ever reach two workers, the second waits for the first instead of colliding with it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path
from typing import Iterator

WAIT_S = 240.0  # under the tests' timeout (300 s): a stuck holder fails the waiter with a clear reason


@contextlib.contextmanager
def one_worker_at_a_time(tmp_path_factory, name: str) -> Iterator[None]:
    """Hold the session-wide lock NAME; the session's workers share the base temp's parent."""
    root = Path(tmp_path_factory.getbasetemp())
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # pytest-N/, which holds every worker's popen-gwK/
    fd = os.open(root / f"{name}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        _acquire(fd, name)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _acquire(fd: int, name: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise AssertionError(f"another worker held the {name} lock for {WAIT_S:.0f} s") from None
            time.sleep(0.2)  # a lock has no event to await; the wait is bounded above
