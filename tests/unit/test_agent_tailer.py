"""The agent's tailer relays workers' log files as whole-line chunks, in order, to the last byte."""

import threading
from pathlib import Path

from orchestrator import wire
from orchestrator.agent import Tailer, Writer


class Sink:
    def __init__(self) -> None:
        self.data = bytearray()
        self.lock = threading.Lock()

    def write(self, b: bytes) -> None:
        with self.lock:
            self.data += b

    def flush(self) -> None:
        pass


def frames(sink: Sink) -> list:
    return wire.Decoder().feed(bytes(sink.data))


def test_whole_lines_per_rank_and_stream_and_the_unterminated_tail_at_the_end(tmp_path: Path):
    attempt = tmp_path / "run_abc" / "attempt_0"
    for rank in (0, 1):
        (attempt / str(rank)).mkdir(parents=True)
    out0, err1 = attempt / "0" / "stdout.log", attempt / "1" / "stderr.log"
    sink = Sink()
    writer = Writer(sink)
    tailer = Tailer(str(tmp_path), writer)
    with out0.open("ab", buffering=0) as f, err1.open("ab", buffering=0) as g:
        f.write(b"first\nsec")  # a line cut mid-write must not be sent in two pieces
        tailer.scan()
        tailer.relay_all(flush=False)
        f.write(b"ond\n" + b"x" * 100_000 + b"\nno newline")
        g.write(b"err line\n")
    tailer.start()
    tailer.finish(stall_timeout=5)
    assert writer.drain(5)
    chunks = [f for f in frames(sink) if isinstance(f, wire.Output)]
    by_stream: dict = {}
    for c in chunks:
        assert c.data.endswith(b"\n")
        by_stream.setdefault((c.stream, c.rank), []).extend(c.lines())
    assert by_stream == {("out", 0): ["first", "second", "x" * 100_000, "no newline"], ("err", 1): ["err line"]}
    assert chunks[0].lines() == ["first"]


def test_nothing_to_relay_without_log_files(tmp_path: Path):
    sink = Sink()
    tailer = Tailer(str(tmp_path / "missing"), Writer(sink))
    tailer.start()
    tailer.finish(stall_timeout=5)
    assert not tailer.thread.is_alive() and frames(sink) == []
