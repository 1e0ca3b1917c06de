"""Signals are recorded, and acted on where the code chooses: parallel waits, start-up, the CLI."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from orchestrator.errors import Interrupted
from orchestrator.remote.parallel import interruptible, on_each
from orchestrator.remote.signals import SignalInbox


def test_a_recorded_signal_wakes_a_parallel_wait_which_aborts_the_calls_and_raises():
    inbox = SignalInbox()
    release = threading.Event()
    aborted = []

    def abort() -> None:
        aborted.append(True)
        release.set()

    threading.Timer(0.05, inbox._record, args=(signal.SIGINT, None)).start()  # as the handler would
    started = time.monotonic()
    with pytest.raises(Interrupted) as e:
        on_each([1, 2, 3], lambda _: release.wait(30), abort=abort, inbox=inbox)
    assert e.value.signum == signal.SIGINT and aborted == [True]
    assert time.monotonic() - started < 5  # not the calls' 30 s


def test_a_signal_received_before_the_wait_counts_too():
    inbox = SignalInbox()
    inbox._record(signal.SIGTERM, None)
    with pytest.raises(Interrupted) as e:
        interruptible(lambda: time.sleep(30), inbox=inbox)
    assert e.value.signum == signal.SIGTERM


def test_results_come_back_in_order_and_a_calls_error_is_raised_after_all_ended():
    assert on_each([3, 1, 2], lambda x: x * 10, inbox=SignalInbox()) == [30, 10, 20]
    ended = []

    def call(x: int) -> int:
        if x == 1:
            raise ValueError("boom")
        time.sleep(0.05)
        ended.append(x)
        return x

    with pytest.raises(ValueError, match="boom"):
        on_each([1, 2, 3], call, inbox=SignalInbox())
    assert sorted(ended) == [2, 3]


def test_without_an_inbox_nothing_interrupts_the_wait():
    inbox = SignalInbox()
    inbox._record(signal.SIGINT, None)
    assert on_each([1], lambda x: x, inbox=None) == [1]


def test_the_inbox_restores_the_handlers_it_replaced():
    before = signal.getsignal(signal.SIGHUP)
    inbox = SignalInbox()
    inbox.install()
    try:
        assert signal.getsignal(signal.SIGHUP) == inbox._record
        os.kill(os.getpid(), signal.SIGHUP)  # recorded, not raised
        deadline = time.monotonic() + 5
        while not inbox.received and time.monotonic() < deadline:
            time.sleep(0.01)
        assert inbox.received == [signal.SIGHUP]
    finally:
        inbox.uninstall()
    assert signal.getsignal(signal.SIGHUP) == before


def _catches(pid: int, sig: int) -> bool:
    from orchestrator.node.local.procs import catches

    return catches(pid, sig)


def test_ctrl_c_while_ddp_up_is_still_starting_ends_with_one_message_and_130(tmp_path):
    """The entry point records signals before it imports the rest: a Ctrl-C during the imports is
    acted on at the first start-up check. Python catches SIGINT by itself from the start, SIGHUP
    only once the inbox is installed: that is the moment to send it."""
    cluster = tmp_path / "c.yaml"
    cluster.write_text("transport: local\nnodes: [{host: a, gpus: 1}]\n")
    proc = subprocess.Popen([sys.executable, "-c", "from orchestrator.commands.entry import up; up()", str(cluster),
                             "train.py"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 20
        while not _catches(proc.pid, signal.SIGHUP) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.001)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, (out, err)
    assert err.decode().strip() == "ddp-up: SIGINT before the job started; nothing was started"
    assert b"Traceback" not in out + err
