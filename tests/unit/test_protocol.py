"""The wire protocol: one vocabulary for both ends, and what is not a frame is an error."""

import ast
import marshal
import subprocess
import sys

import pytest

from orchestrator import agent, nodefacts, protocol, wire

EXAMPLES = [
    wire.RunSpec(job="j", node=1, cluster="c", run="r1", workdir=None, script="t.py", env={"A": "1"}, pick_port=True,
                 check_port=None, orphan_timeout=30.0, stop_grace=10.0, heartbeat=5.0, stack_dumps=False),
    wire.DetectSpec(env={}), wire.SweepSpec(match={"DDP_UP_JOB": "j"}, grace=1.0, dry_run=True),
    wire.SyncSpec(dest="~/p", entries=[["a", 1, 2, 0o644, None]], idle_timeout=9.0),
    wire.Heartbeat(), wire.Probe(addr="10.0.0.1", port=29500, timeout=3.0), wire.Go(argv=["python", "-u", "x"]),
    wire.Dump(), wire.Stop(), wire.Kill(), wire.AskShared(markers=[".ddp-up-sync-1"]), wire.EndOfFiles(),
    wire.Ready(hostname="n", python="3.11", torch="2.13.0", cuda=None, nccl=None, gpus=0, time=1.5,
               disk_free=10, port=1234),
    wire.Failed(what="no", fix="yes"), wire.Probed(ok=False, error="refused"), wire.Started(),
    wire.Output(stream="err", rank=None, data=b"W 1\n\x00\xff not a frame\n"), wire.Dumped(ranks=[0, 3]),
    wire.Stopping(reason="asked"), wire.Exited(code=-9, signal="SIGKILL", stopped=False, reason=None),
    wire.Detected(gpus=8), wire.Listed(found=[{"pid": 1, "tags": {}, "cmd": "x"}]), wire.Swept(killed=[], left=[2]),
    wire.Needs(dest="/p", need=[0, 2], marker="m"), wire.Shared(sees=[]), wire.Copied(files=1, bytes=2, links=3),
    wire.FollowSpec(job="j", node=1, follow=True), wire.ListSpec(), wire.JournalEnd(running=False),
    wire.Jobs(jobs=[{"job": "j", "node": 0, "state": "done"}]), wire.GpuUsage(gpus=[[0, 87, 61000, 81559]]),
]
PEER_EXAMPLES = [wire.Challenge(nonce="ab"), wire.Join(node=2, proof="cd"), wire.Heartbeat(),
                 wire.NodeState(node=2, state="failed", code=7), wire.Progress(node=2, quiet=1.5), wire.DumpStacks(),
                 wire.Halt(reason="node 2 failed (exit code 7)"), wire.Restart(attempt=1, port=29501),
                 wire.RunOver(reason="every node done")]


def test_every_frame_kind_has_an_example_and_one_meaning():
    kinds = {type(f) for f in EXAMPLES} | {wire.File}
    assert kinds == set(wire.TO_AGENT.values()) | set(wire.TO_CONTROLLER.values())
    # A kind name means one thing: only the heartbeat travels both ways.
    assert set(wire.TO_AGENT) & set(wire.TO_CONTROLLER) == {b"Heartbeat"}


def test_a_detached_jobs_agents_speak_frames_of_their_own():
    import io

    assert set(wire.PEER.values()) == {type(f) for f in PEER_EXAMPLES}
    assert set(wire.PEER) & (set(wire.TO_AGENT) | set(wire.TO_CONTROLLER)) == {b"Heartbeat"}
    stream = io.BytesIO(b"".join(f.encode() for f in PEER_EXAMPLES))
    assert [wire.read_frame(stream, wire.PEER) for _ in PEER_EXAMPLES] == PEER_EXAMPLES
    with pytest.raises(wire.ProtocolError, match="unexpected frame"):  # a controller's frame is not a peer's
        wire.read_frame(io.BytesIO(wire.Stop().encode()), wire.PEER)


def test_every_frame_survives_the_wire_byte_by_byte():
    to_controller = [f for f in EXAMPLES if type(f) in wire.TO_CONTROLLER.values()]
    stream = b"".join(f.encode() for f in to_controller)
    decoder = wire.Decoder(wire.TO_CONTROLLER)
    got = [frame for i in range(len(stream)) for frame in decoder.feed(stream[i:i + 1])]
    assert got == to_controller and decoder.at_rest()
    assert got[to_controller.index(EXAMPLES[16])].lines() == ["W 1", "\x00\udcff not a frame"]  # bytes kept


def test_the_agent_side_reads_the_controllers_frames_from_a_stream():
    import io

    to_agent = [f for f in EXAMPLES if type(f) in wire.TO_AGENT.values()]
    stream = io.BytesIO(b"".join(f.encode() for f in to_agent) + wire.File(index=0, size=3, mtime_ns=5).encode() + b"abc")
    got = [wire.read_frame(stream) for _ in to_agent]
    assert got == to_agent
    assert wire.read_frame(stream) == wire.File(index=0, size=3, mtime_ns=5) and stream.read() == b"abc"
    assert wire.read_frame(stream) is None


@pytest.mark.parametrize("data, error", [
    (b"Bogus {}\n", "unexpected frame 'Bogus {}'"),
    (b"O some launcher line\n", "unexpected frame 'O some launcher line'"),  # the old protocol's letters
    (b"Go {\"argv\": []}\n", "unexpected frame"),  # a controller frame, coming from an agent
    (b"Exited {not json\n", "malformed Exited frame (not JSON)"),
    (b"Exited [1]\n", "malformed Exited frame (not an object)"),
    (b"Exited {\"code\": 0}\n", "malformed Exited frame"),  # missing fields
    (b"Detected {\"gpus\": 1, \"extra\": 2}\n", "malformed Detected frame"),  # unknown field
    (b"Output {\"stream\": \"out\", \"rank\": 0, \"size\": -1}\n", "malformed Output frame (size -1)"),
])
def test_what_is_not_a_frame_is_a_protocol_error(data, error):
    with pytest.raises(wire.ProtocolError, match=error.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        wire.Decoder(wire.TO_CONTROLLER).feed(data)


def test_an_endless_header_is_an_error_not_a_memory_leak(monkeypatch):
    monkeypatch.setattr(wire, "MAX_HEADER", 1000)
    with pytest.raises(wire.ProtocolError, match="header line"):
        wire.Decoder().feed(b"x" * 2000)


def test_hello_is_the_sources_and_their_bytecode_then_the_spec():
    data = b"".join(protocol.hello(wire.SweepSpec(match={}, grace=1.0, dry_run=True)))
    sizes = [int(n) for n in protocol.bootstrap_args()[-6:]]
    parts, at = [], 0
    for size in sizes:
        parts.append(data[at:at + size])
        at += size
    assert parts[:3] == [open(m.__file__, "rb").read() for m in (wire, nodefacts, agent)]
    codes = [marshal.loads(p) for p in parts[3:]]
    assert [c.co_filename for c in codes] == ["ddp_up_wire", "ddp_up_nodefacts", "ddp_up_agent"]
    assert data[at:] == b'SweepSpec {"match": {}, "grace": 1.0, "dry_run": true, "purge": false}\n'


def _run_agent(args, data):
    return subprocess.run([sys.executable, "-u", *args], input=data, capture_output=True, timeout=30)


@pytest.mark.parametrize("key", ["same", "other", "no bytecode"])
def test_an_agent_runs_the_shipped_bytecode_or_compiles_the_sources(key):
    """Bytecode is used only by the Python it was made by (same cache tag and magic number);
    any other compiles the sources. Each way, the agent runs and answers its spec."""
    args, parts = protocol.bootstrap_args(), list(protocol.shipped())
    if key == "other":
        args[3] = "cpython-38" + "55" * 4  # another Python's key: its bytecode would not load here
        parts[3:] = [b"not bytecode"] * 3  # proves it is never read as code
    elif key == "no bytecode":
        parts[3:] = [b""] * 3
    args[-6:] = [str(len(p)) for p in parts]
    spec = wire.SweepSpec(match={"DDP_UP_JOB": "no-such-job-anywhere"}, grace=0.0, dry_run=True)
    proc = _run_agent(args, b"".join(parts) + spec.encode())
    assert proc.returncode == 0, proc.stderr
    assert wire.Decoder().feed(proc.stdout)[0] == wire.Listed(found=[])


def test_an_agent_given_garbage_instead_of_a_spec_says_so_and_exits():
    proc = _run_agent(protocol.bootstrap_args(), b"".join(protocol.shipped()) + b"Hello there\n")
    assert proc.returncode == 3
    assert wire.Decoder().feed(proc.stdout) == [wire.Failed(
        "protocol error from the controller: unexpected frame 'Hello there'",
        "use the same ddp-up version on both ends")]


def _top_level_imports(module) -> set[str]:
    tree = ast.parse(open(module.__file__, encoding="utf-8").read())
    names = set()
    for node in tree.body:  # top level only: the agent's package import is inside a try
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("module", [agent, nodefacts, wire])
def test_what_nodes_run_is_stdlib_only(module):
    """Nodes have nothing but Python: the shipped sources import neither the package nor deps."""
    assert _top_level_imports(module) <= sys.stdlib_module_names


@pytest.mark.parametrize("module", [agent, nodefacts, wire])
def test_what_nodes_run_parses_as_python_3_8(module):
    """The agent says it needs Python 3.8+ on the nodes: no newer syntax may slip in."""
    ast.parse(open(module.__file__, encoding="utf-8").read(), feature_version=(3, 8))


def test_frames_are_immutable_values_with_checked_fields():
    ready = wire.Ready(hostname="n", python="3.11", torch=None, cuda=None, nccl=None, gpus=0, time=1.0,
                       disk_free=2)
    assert ready.port is None  # a default
    assert ready == wire.Ready("n", "3.11", None, None, None, 0, 1.0, 2) and hash(ready) == hash(
        wire.Ready("n", "3.11", None, None, None, 0, 1.0, 2))
    assert ready != wire.Ready("n", "3.11", None, None, None, 0, 1.0, 2, port=5)
    with pytest.raises(AttributeError):
        ready.gpus = 8
    with pytest.raises(TypeError, match="missing field.*disk_free"):
        wire.Ready(hostname="n", python="3.11", torch=None, cuda=None, nccl=None, gpus=0, time=1.0)
    with pytest.raises(TypeError, match="unknown field.*colour"):
        wire.Failed("what", colour="red")
    with pytest.raises(TypeError, match="twice"):
        wire.Failed("what", what="again")
    assert repr(wire.Output("out", 0, b"secret bytes")) == "Output(stream='out', rank=0)"  # never the data
