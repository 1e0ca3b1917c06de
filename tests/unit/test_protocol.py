import json

from orchestrator import agent, protocol


def test_line_splitter_keeps_partial_lines():
    s = protocol.LineSplitter()
    assert s.feed(b"O hel") == []
    assert s.feed(b"lo\nE x\nH") == [b"O hello", b"E x"]
    assert s.flush() == [b"H"]
    assert s.flush() == []


def test_split_frame():
    assert protocol.split_frame(b"O a b") == (b"O", b"a b")
    assert protocol.split_frame(b"H") == (b"H", b"")


def test_hello_is_source_then_spec():
    data = protocol.hello({"mode": "sweep"})
    n = int(protocol.bootstrap_args()[-1])
    assert data[:n] == agent.source()
    assert json.loads(data[n:]) == {"mode": "sweep"}


def test_agent_source_is_stdlib_only():
    """Nodes have nothing but Python: the shipped agent must not import the package or deps."""
    src = agent.source().decode()
    imports = {line.split()[1].split(".")[0] for line in src.splitlines() if line.startswith(("import ", "from "))}
    assert imports <= {"errno", "json", "os", "queue", "shutil", "signal", "socket", "subprocess",
                       "sys", "tempfile", "threading", "time"}
