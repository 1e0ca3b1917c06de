"""The agent's tailer relays workers' log files as whole-line chunks, in order, to the last byte."""

import io
import threading
from pathlib import Path

from orchestrator.node.protocol import wire
from orchestrator.node.watch.relay import Tailer, Writer


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
        by_stream.setdefault((c.stream, c.rank), []).extend(c.lines())
    assert by_stream == {("out", 0): ["first", "second", "x" * 100_000, "no newline"], ("err", 1): ["err line"]}
    assert chunks[0].lines() == ["first"]
    assert b"".join(c.data for c in chunks if c.stream == "out") == out0.read_bytes()  # the very bytes
    assert not chunks[-1].data.endswith(b"\n") or chunks[-1].stream == "err"  # nothing added at the end


def relay_whole(root: Path, stdout: bytes) -> tuple[Tailer, list]:
    """Rank 0's stdout.log holding ``stdout``, relayed to its end: the tailer, and its Output frames."""
    attempt = root / "run" / "attempt_0" / "0"
    attempt.mkdir(parents=True)
    (attempt / "stdout.log").write_bytes(stdout)
    sink = Sink()
    writer = Writer(sink)
    tailer = Tailer(str(root), writer)
    tailer.start()
    tailer.finish(stall_timeout=5)
    assert writer.drain(5)
    return tailer, [f for f in frames(sink) if isinstance(f, wire.Output)]


def test_a_line_of_several_megabytes_arrives_in_pieces_and_every_byte_of_it(tmp_path: Path):
    # 3 MB of every byte value but \r (a carriage return makes the line a bar: test_screen.py), C1 CSI, bad UTF-8
    huge = bytes(b for b in range(256) if b != 13) * 12_000 + b"\x9b[2J\xff"
    _, chunks = relay_whole(tmp_path, b"before\n" + huge + b"\nafter")
    assert b"".join(c.data for c in chunks) == b"before\n" + huge + b"\nafter"
    assert max(len(c.data) for c in chunks) <= 2 << 20  # pieces, not one 3 MB frame
    pieces = [p for c in chunks for p in c.pieces()]
    joined = "".join(text for text, _ in pieces).encode("utf-8", "surrogateescape")
    assert joined == (b"before" + huge + b"after").replace(b"\n", b"")  # text keeps every byte, newlines aside
    assert pieces[-1] == ("after", True)  # unterminated: no newline invented


def test_nothing_to_relay_without_log_files(tmp_path: Path):
    sink = Sink()
    tailer = Tailer(str(tmp_path / "missing"), Writer(sink))
    tailer.start()
    tailer.finish(stall_timeout=5)
    assert not tailer.thread.is_alive() and frames(sink) == []


def test_a_relay_that_dies_says_so_and_is_never_silent(tmp_path: Path, monkeypatch):
    """Whatever fails inside the relay (a bug: the job's bytes never raise), the node's output
    says so and ``died`` makes the run's end a failure (run.finish), not an "ok" without logs."""
    from orchestrator.node.watch import relay

    def broken(self, data):
        raise ValueError("a bug")
    monkeypatch.setattr(relay.Screen, "feed", broken)
    tailer, chunks = relay_whole(tmp_path, b"a line\n")
    assert tailer.died == "the relay of this node's rank output stopped (ValueError: a bug)"
    said = [f.data for f in chunks if f.rank is None]
    assert said == [b"ddp-up: the relay of this node's rank output stopped (ValueError: a bug); the run counts as "
                    b"failed\n"]


def test_a_detached_writer_notes_which_ranks_have_begun():
    """A line, a bar, or its process group up (RanksUp, global ranks): the rank has begun, and its
    hang clock starts then; the launcher's own lines start nobody's."""
    writer = Writer(io.BytesIO())
    writer.begun, writer.first_rank = set(), 4
    writer.send(wire.Output("err", None, b"torchrun's own warning\n"))
    assert writer.begun == set()
    writer.send(wire.Output("out", 1, b"hello\n"))
    writer.send(wire.Bars(bars=[["err", 2, ["epoch 0: 3/10"]]]))
    before = writer.last_output
    writer.send(wire.RanksUp(ranks=[4]))
    assert writer.begun == {0, 1, 2} and writer.last_output >= before
    assert writer.drain(5)


def test_a_drain_waits_for_a_frame_queued_while_the_writer_found_the_queue_empty(monkeypatch):
    """A one-shot agent sends its last frame (ddp-kill's Swept), drains and exits. The writer, done
    with the frame before, looked at the queue while that one was on its way in, found it empty
    and called the writer idle: the drain returned at once, and the agent exited without its last
    frame (a ddp-kill in a full suite run, "the agent ended without Swept"). Here the frame's way
    into the queue is slowed, so that the writer looks in that moment each time."""
    import queue
    import time

    class SlowIn(queue.Queue):
        def put(self, item, block=True, timeout=None):
            if item == b"last":
                time.sleep(0.5)  # the writer is done with "first" meanwhile, and looks
            super().put(item, block, timeout)

    class SlowSink(Sink):
        def write(self, b: bytes) -> None:
            time.sleep(0.05)
            super().write(b)

    monkeypatch.setattr(queue, "Queue", SlowIn)
    sink = SlowSink()
    writer = Writer(sink)
    writer.put(b"first")
    writer.put(b"last")
    assert writer.drain(5)
    assert bytes(sink.data) == b"firstlast"
