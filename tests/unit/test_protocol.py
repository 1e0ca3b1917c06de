import json
import sys

import pytest

from orchestrator import agent, protocol, spawner


def test_line_splitter_keeps_partial_lines():
    s = protocol.LineSplitter()
    assert s.feed(b"O hel") == []
    assert s.feed(b"lo\nE x\nH") == [b"O hello", b"E x"]
    assert s.flush() == [b"H"]
    assert s.flush() == []


def test_split_frame():
    assert protocol.split_frame(b"O a b") == (b"O", b"a b")
    assert protocol.split_frame(b"H") == (b"H", b"")


def test_frame_reader_takes_worker_chunks_whole_whatever_they_hold():
    chunk = b"line one\nW E 0 3\n\x00\xff\n"  # looks like a frame header, and is not UTF-8
    stream = b"H\nW O 2 %d\n" % len(chunk) + chunk + b"X {\"code\": 0}\n"
    reader = protocol.FrameReader()
    frames = [f for i in range(len(stream)) for f in reader.feed(stream[i:i + 1])]  # byte by byte
    assert frames == [(b"H", b""), (b"W", protocol.WorkerChunk("out", 2, chunk)), (b"X", b'{"code": 0}')]
    assert frames[1][1].lines() == ["line one", "W E 0 3", "\x00\ufffd"]
    assert reader.feed(b"") == [] and not reader.buf


def test_hello_is_source_then_spec():
    data = protocol.hello({"mode": "sweep"})
    n = int(protocol.bootstrap_args()[-1])
    assert data[:n] == agent.source()
    assert json.loads(data[n:]) == {"mode": "sweep"}


@pytest.mark.parametrize("module", [agent, spawner])
def test_what_nodes_run_is_stdlib_only(module):
    """Nodes have nothing but Python: the shipped agent and launcher import neither the package nor deps."""
    with open(module.__file__, encoding="utf-8") as f:
        src = f.read()
    imports = {line.split()[1].split(".")[0] for line in src.splitlines() if line.startswith(("import ", "from "))}
    assert imports <= sys.stdlib_module_names - {"__future__"}
