"""What a rank plants in the directories it can write (the Flight Recorder's, torchrun's log
directory): a FIFO or a link under a record's or a log's name is never opened as one, and nothing
blocks the agent. Each read runs on a thread with a bound, so a regression fails, not hangs."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from orchestrator.node.watch import failures, flight
from orchestrator.node.protocol import wire
from orchestrator.node.watch.relay import Tailer, Writer
from tests.unit.test_agent_tailer import Sink, frames


def bounded(work, seconds: float = 5.0):
    result = []
    t = threading.Thread(target=lambda: result.append(work()), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "blocked on a planted file"
    return result[0]


def test_a_fifo_or_a_link_named_like_a_record_is_not_read_and_blocks_nothing(tmp_path: Path):
    os.mkfifo(tmp_path / "nccl.0.json")
    os.mkfifo(tmp_path / "fr.1.json")
    secret = tmp_path / "elsewhere"
    secret.write_text('{"entries": []}')
    os.symlink(secret, tmp_path / "fr.2.json")
    os.mkfifo(tmp_path / "up.3")  # a name only: never opened, and still only a name
    assert bounded(lambda: flight.read_records(str(tmp_path))) == {}
    assert bounded(lambda: flight.ranks_up(str(tmp_path), set())) == [3]


def test_a_fifo_as_a_ranks_log_or_error_file_blocks_neither_the_relay_nor_the_failures(tmp_path: Path):
    rank = tmp_path / "run" / "attempt_0" / "0"
    rank.mkdir(parents=True)
    os.mkfifo(rank / "stdout.log")
    os.mkfifo(rank / "error.json")
    (rank / "stderr.log").write_text("Traceback (most recent call last):\n  File \"t.py\"\nValueError: x\n")
    sink = Sink()
    writer = Writer(sink)
    tailer = Tailer(str(tmp_path), writer)
    bounded(lambda: (tailer.scan(), tailer.relay_all(flush=True)))
    assert writer.drain(5)
    assert [f.data for f in frames(sink) if isinstance(f, wire.Output)] == \
        [b"Traceback (most recent call last):\n  File \"t.py\"\nValueError: x\n"]
    [found] = bounded(lambda: failures.rank_failures(str(tmp_path)))
    assert found["exception"] == "ValueError: x" and found["error_file"] is None
