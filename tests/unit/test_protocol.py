"""The wire protocol: one vocabulary for both ends, and what is not a frame is an error."""

import ast
import hashlib
import marshal
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator import node
from orchestrator.node import boot
from orchestrator.remote import protocol
from orchestrator.node.protocol import wire
from orchestrator.node.main import MODES
from tests.harness.procs import wait_for

EXAMPLES = [
    wire.RunSpec(job="j", node=1, cluster="c", run="r1", workdir=None, script="t.py", env={"A": "1"}, pick_port=True,
                 check_port=None, orphan_timeout=30.0, stop_grace=10.0, heartbeat=5.0, stack_dumps=False),
    wire.DetectSpec(env={}), wire.SweepSpec(match={"DDP_UP_JOB": "j"}, grace=1.0, dry_run=True),
    wire.SyncSpec(dest="~/p", entries=[["a", 1, 2, 0o644, None]], idle_timeout=9.0),
    wire.Heartbeat(), wire.Probe(addr="10.0.0.1", port=29500, timeout=3.0), wire.Go(argv=["python", "-u", "x"]),
    wire.Dump(), wire.Signal(name="SIGUSR1"), wire.Stop(), wire.Kill(), wire.AskShared(markers=[".ddp-up-sync-1"]), wire.EndOfFiles(),
    wire.Ready(hostname="n", python="3.11", torch="2.13.0", cuda=None, nccl=None, gpus=0, time=1.5,
               disk_free=10, port=1234),
    wire.Failed(what="no", fix="yes"), wire.Probed(ok=False, error="refused"), wire.Started(),
    wire.Output(stream="err", rank=None, data=b"W 1\n\x00\xff not a frame\n"), wire.Dumped(ranks=[0, 3]),
    wire.Stopping(reason="asked"), wire.Exited(code=-9, signal="SIGKILL", stopped=False, reason=None),
    wire.Result(rank=3, problem=None, data=b"\x80\x05K*."), wire.Result(rank=4, problem="its result is over 8 MiB", data=b""),
    wire.Detected(gpus=8), wire.Listed(found=[{"pid": 1, "tags": {}, "cmd": "x"}]), wire.Swept(killed=[], left=[2]),
    wire.Needs(dest="/p", need=[0, 2], marker="m"), wire.Shared(sees=[]), wire.Copied(files=1, bytes=2, links=3),
    wire.FollowSpec(job="j", node=1, follow=True), wire.ListSpec(), wire.JournalEnd(running=False), wire.Stamp(at=1.5), wire.Replayed(),
    wire.FetchSpec(root="~", path="ckpt"), wire.Want(indices=[0, 2]), wire.Listing(base="/w/ckpt", entries=[["a", 1, 0, 420, None]]),
    wire.Chunk(index=0, end=True, data=b"x\n"), wire.Sent(files=1, bytes=2),
    wire.Jobs(jobs=[{"job": "j", "node": 0, "state": "done"}]), wire.GpuUsage(gpus=[[0, 87, 61000, 81559]]),
    wire.Collectives(ranks={"0": [["0", "default_pg", 3, "all_reduce", False, [[4]], ["Float"], [[4]], ["Float"], 1]]}),
    wire.Arrivals(times=[["0", 3, 1795506773.25, 1]]),
    wire.RanksUp(ranks=[0, 1]), wire.RanksEnded(),
    wire.KeepSpec(name="0123abcd-1", env={"A": "1"}, preload=["json"], nproc=2, orphan_timeout=30.0),
    wire.Kept(ready=False, why="importing x initialized CUDA", seconds=None),
    wire.Bars(bars=[["err", 0, [" 45%|####      | 450/1000 [00:12<00:15, 36.20it/s]"]]]),
]
PEER_EXAMPLES = [wire.Challenge(nonce="ab"), wire.Join(node=2, proof="cd"), wire.Heartbeat(),
                 wire.NodeState(node=2, state="failed", code=7), wire.Progress(node=2, quiet=1.5), wire.DumpStacks(),
                 wire.Halt(reason="node 2 failed (exit code 7)"), wire.Restart(attempt=1, port=29501),
                 wire.RunOver(reason="every node done"), wire.Arrivals(times=[["0", 3, 1.25, 1]])]


def test_every_frame_kind_has_an_example_and_one_meaning():
    kinds = {type(f) for f in EXAMPLES} | {wire.File}
    assert kinds == set(wire.TO_AGENT.values()) | set(wire.TO_CONTROLLER.values())
    # A kind name means one thing: only the heartbeat travels both ways.
    assert set(wire.TO_AGENT) & set(wire.TO_CONTROLLER) == {b"Heartbeat"}


def test_a_detached_jobs_agents_speak_frames_of_their_own():
    import io

    assert set(wire.PEER.values()) == {type(f) for f in PEER_EXAMPLES}
    assert set(wire.PEER) & (set(wire.TO_AGENT) | set(wire.TO_CONTROLLER)) == {b"Heartbeat", b"Arrivals"}
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
    assert got[to_controller.index(EXAMPLES[17])].lines() == ["W 1", "\x00\udcff not a frame"]  # bytes kept


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


def _parts(data: bytes) -> tuple[bytes, list[str], list[bytes], bytes]:
    """(the loader, the header's words, the parts it sizes, what follows them) of an agent's stdin."""
    size, _, rest = data.partition(b"\n")
    loader, rest = rest[:int(size)], rest[int(size):]
    header, _, rest = rest.partition(b"\n")
    words = header.decode().split()
    parts, at = [], 0
    for size in map(int, words[3:]):
        parts.append(rest[at:at + size])
        at += size
    return loader, words, parts, rest[at:]


def test_hello_is_a_header_the_mode_s_sources_and_their_bytecode_then_the_spec():
    loader, words, parts, spec = _parts(b"".join(protocol.hello(wire.SweepSpec(match={}, grace=1.0, dry_run=True))))
    names = protocol.modules_for(wire.SweepSpec)
    assert loader == Path(boot.__file__).read_bytes()
    assert words[:3] == [protocol.bytecode_key(), "ddp_up_node", ",".join(names)]
    assert len(parts) == 2 * len(names)
    assert parts[:len(names)] == [path.read_bytes() for path in protocol.module_paths(names)]
    codes = [marshal.loads(p) for p in parts[len(names):]]
    assert [c.co_filename for c in codes] == ["ddp_up_node." + name for name in names]
    assert spec == b'SweepSpec {"match": {}, "grace": 1.0, "dry_run": true, "purge": false, "signal": null, "runtimes": null}\n'


def test_the_shipped_bytecode_is_kept_for_the_next_command_and_a_damaged_or_open_copy_is_not_used(tmp_path, monkeypatch):
    """Compiling the node package costs every command 0.1 s of CPU: its bytecode is kept in the
    user's own cache folder, per module and source; what was kept equals a fresh compile."""
    import os

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    protocol._compiled.cache_clear()
    fresh = protocol.compiled()
    kept = sorted((tmp_path / "ddp-up" / "bytecode").iterdir())
    assert len(kept) == len(node.SHIPPED) and oct(kept[0].parent.stat().st_mode & 0o777) == "0o700"
    protocol._compiled.cache_clear()
    assert protocol.compiled() == fresh  # read back, the same bytes
    first = kept[0]
    first.write_bytes(first.read_bytes()[:-7])  # cut short: compiled again, and kept whole again
    protocol._compiled.cache_clear()
    assert protocol.compiled() == fresh and protocol.read_kept(str(first)) is not None
    forged = first.read_bytes()[: protocol.DIGEST] + b"not the code"
    first.write_bytes(forged)  # its digest no longer matches
    assert protocol.read_kept(str(first)) is None
    first.write_bytes(hashlib.sha256(b"x").digest() + b"x")  # a well-formed file in a folder others can write
    os.chmod(first.parent, 0o777)
    assert protocol.read_kept(str(first)) is None
    os.chmod(first.parent, 0o700)
    assert protocol.read_kept(str(first)) == b"x"
    stale = first.with_name(first.name.rpartition("-")[0] + "-" + "0" * 32)
    stale.write_bytes(b"")
    first.unlink()
    protocol._compiled.cache_clear()
    protocol.compiled()  # an earlier source's bytecode of the same module is removed as the new one is kept
    assert not stale.exists() and first.exists()
    protocol._compiled.cache_clear()


def test_nothing_the_agent_runs_is_on_its_command_line():
    """The command line is a few words that read the loader from stdin, then the agent's name: ssh
    starts before anything is compiled."""
    assert protocol.bootstrap_args() == ["-S", "-c", protocol.STUB, protocol.AGENT_MARK]
    assert len(protocol.STUB) < 80 and "\n" not in protocol.STUB
    tags = {"DDP_UP_JOB": "20261128-000000-abcdef", "DDP_UP_NODE": "3", "DDP_UP_RUN": "secret-ish"}
    assert protocol.bootstrap_args(tags)[3:] == [protocol.AGENT_MARK, "job=20261128-000000-abcdef", "node=3"]


def test_a_running_agent_shows_in_ps_as_its_name_job_and_node_only():
    """ps shows an agent as one short line that says what it is, not its loader."""
    tags = {"DDP_UP_JOB": "20261128-000000-abcdef", "DDP_UP_NODE": "3"}
    proc = subprocess.Popen([sys.executable, "-u", *protocol.bootstrap_args(tags)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        proc.stdin.write(b"".join(protocol.shipped(wire.ListSpec)))  # no spec yet: it waits for one, named
        proc.stdin.flush()
        shown = lambda: Path(f"/proc/{proc.pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        assert wait_for(lambda: shown()[0] == protocol.AGENT_MARK.encode(), timeout=20, interval=0.01), shown()
        assert shown() == [b"ddp-up-agent", b"job=20261128-000000-abcdef", b"node=3"]
        assert Path(f"/proc/{proc.pid}/comm").read_text().strip() == "ddp-up-agent"
    finally:
        proc.kill()
        proc.communicate(timeout=10)


@pytest.mark.parametrize("mode", list(MODES), ids=lambda m: m.__name__)
def test_each_mode_is_shipped_main_its_module_and_what_they_import(mode):
    names = protocol.modules_for(mode)
    assert names == tuple(n for n in node.SHIPPED if n in names)  # in the order the loader runs them
    assert {"protocol.wire", "main", MODES[mode].rpartition(".")[0]} <= set(names)
    for name in names:
        assert _imports(name)[1] <= set(names), name
    assert protocol.modules_for(None) == node.SHIPPED


def test_fetch_and_ls_agents_run_a_fraction_of_the_package():
    for mode in (wire.FetchSpec, wire.ListSpec, wire.SyncSpec):
        assert len(protocol.modules_for(mode)) <= len(node.SHIPPED) // 2


@pytest.mark.parametrize("name", node.SHIPPED)
def test_the_import_scan_finds_what_the_parser_finds(name):
    """modules_for reads imports as text, for speed; it must agree with Python's own parse."""
    assert node.imports(name) == _imports(name)[1]


def _run_agent(args, data):
    return subprocess.run([sys.executable, "-u", *args], input=data, capture_output=True, timeout=30)


def _with_header(loader: bytes, words: list[str], parts: list[bytes]) -> bytes:
    header = (" ".join(words[:3] + [str(len(p)) for p in parts]) + "\n").encode()
    return b"%d\n" % len(loader) + loader + header + b"".join(parts)


@pytest.mark.parametrize("key", ["same", "other", "no bytecode"])
def test_an_agent_runs_the_shipped_bytecode_or_compiles_the_sources(key):
    """Bytecode is used only by the Python it was made by (same cache tag and magic number);
    any other compiles the sources. Each way, the agent runs and answers its spec."""
    loader, words, parts, _ = _parts(b"".join(protocol.shipped(wire.SweepSpec)))
    n = len(parts) // 2
    if key == "other":
        words[0] = "cpython-38" + "55" * 4  # another Python's key: its bytecode would not load here
        parts[n:] = [b"not bytecode"] * n  # proves it is never read as code
    elif key == "no bytecode":
        parts[n:] = [b""] * n
    spec = wire.SweepSpec(match={"DDP_UP_JOB": "no-such-job-anywhere"}, grace=0.0, dry_run=True)
    proc = _run_agent(protocol.bootstrap_args(), _with_header(loader, words, parts) + spec.encode())
    assert proc.returncode == 0, proc.stderr
    assert wire.Decoder().feed(proc.stdout)[0] == wire.Listed(found=[])


def test_an_agent_given_garbage_instead_of_a_spec_says_so_and_exits():
    proc = _run_agent(protocol.bootstrap_args(), b"".join(protocol.shipped()) + b"Hello there\n")
    assert proc.returncode == 3
    assert wire.Decoder().feed(proc.stdout) == [wire.Failed(
        "protocol error from the controller: unexpected frame 'Hello there'",
        "use the same ddp-up version on both ends")]


def test_an_agent_sent_another_mode_s_code_says_so_and_exits():
    """A spec the agent has no module for (a controller bug) is a protocol error, not a traceback."""
    data = b"".join(protocol.shipped(wire.ListSpec)) + wire.SweepSpec(match={}, grace=0.0, dry_run=True).encode()
    proc = _run_agent(protocol.bootstrap_args(), data)
    assert proc.returncode == 3, proc.stderr
    assert wire.Decoder().feed(proc.stdout) == [wire.Failed(
        "protocol error from the controller: this agent was not sent the code for SweepSpec",
        "use the same ddp-up version on both ends")]


def _imports(name: str) -> tuple[set[str], set[str]]:
    """(top-level absolute imports, the house's modules it imports, dotted) of the node module
    ``name``, wherever they stand in it (a lazy import inside a function counts too)."""
    tree = ast.parse(protocol.module_paths((name,))[0].read_text(encoding="utf-8"))
    known = set(node.SHIPPED + node.IN_IMAGE)
    absolute, relative = set(), set()
    for item in ast.walk(tree):
        if isinstance(item, ast.Import):
            absolute |= {a.name.split(".")[0] for a in item.names}
        elif isinstance(item, ast.ImportFrom) and item.level == 0:
            absolute.add(item.module.split(".")[0])
        elif isinstance(item, ast.ImportFrom):
            base = ".".join(name.split(".")[:-item.level] + ([item.module] if item.module else []))
            named = {f"{base}.{a.name}".lstrip(".") for a in item.names} & known
            relative |= {base} if base in known else named
    return absolute, relative


@pytest.mark.parametrize("name", node.SHIPPED + node.IN_IMAGE + ("boot",))
def test_what_nodes_run_is_stdlib_only(name):
    """Nodes have nothing but Python: the shipped modules import neither the controller nor deps."""
    absolute, _ = _imports(name)
    assert absolute <= sys.stdlib_module_names


@pytest.mark.parametrize("name", node.SHIPPED)
def test_a_shipped_module_imports_only_shipped_modules_run_before_it(name):
    """The loader runs the modules in SHIPPED's order: each may import only those before it."""
    _, relative = _imports(name)
    assert relative <= set(node.SHIPPED[:node.SHIPPED.index(name)])


@pytest.mark.parametrize("name", node.SHIPPED + node.IN_IMAGE + ("boot",))
def test_what_nodes_run_parses_as_python_3_8(name):
    """The agent says it needs Python 3.8+ on the nodes: no newer syntax may slip in."""
    ast.parse(protocol.module_paths((name,))[0].read_text(encoding="utf-8"), feature_version=(3, 8))


def test_everything_in_the_node_package_is_shipped():
    """One list of what is shipped: a module left out of it would be missing on every node (but
    for those run in a container's image only, sent with the job)."""
    here = Path(node.__file__).parent
    on_disk = {".".join(path.relative_to(here).with_suffix("").parts) for path in here.rglob("*.py")
               if path.name != "__init__.py"} - {"boot"}  # the loader: run from stdin, never a module of the package
    assert on_disk - set(node.IN_IMAGE) == set(node.SHIPPED) and not set(node.IN_IMAGE) & set(node.SHIPPED)


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


def test_the_user_side_package_written_for_the_warm_interpreter_holds_all_it_imports():
    """A module the warm interpreter or a stand-in imports but left out of what the agent writes
    would make every rank start cold."""
    from orchestrator.node.local import ourcode

    written = {"userpython." + module.__name__.rpartition(".")[2] for module in ourcode.IMPORTED}
    assert written == set(node.needs("userpython.warmparent", "userpython.standin"))
