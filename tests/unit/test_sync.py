"""Workdir sync: what is copied (git's ignore rules), and the exchange with a real local agent."""

from __future__ import annotations

import io
import os
from unittest.mock import ANY
import sys
from pathlib import Path

import pytest
from rich.console import Console

from orchestrator.remote import protocol
from orchestrator.node.files import sync as node_sync
from orchestrator.config.clusterfile import parse_cluster
from orchestrator.config.cluster import SyncConfig
from orchestrator.errors import ConfigError, SetupError
from orchestrator.plan.launch import make_plan
from orchestrator.remote.sync import Entry, Tree, scan, sync_all, targets
from orchestrator.views.transfer import LARGE, transfer_progress


def write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def paths(tree: Tree) -> set[str]:
    return {e.path for e in tree.entries}


def test_gitignore_rules_apply_as_git_applies_them(tmp_path):
    write(tmp_path, {
        ".gitignore": "*.log\n!keep.log\nbuild/\n/top-only.txt\n",
        "a/.gitignore": "!a.log\nlocal.txt\n",  # deeper file wins: re-includes what the root ignores
        ".git/info/exclude": "private.txt\n",
        ".git/HEAD": "ref\n",
        "x.log": "", "keep.log": "", "top-only.txt": "", "a/top-only.txt": "", "a/a.log": "", "a/b.log": "",
        "a/local.txt": "", "local.txt": "", "build/out.o": "", "a/build/deep.o": "", "private.txt": "",
        "src/main.py": "",
    })
    tree = scan(SyncConfig(src=str(tmp_path)))
    assert paths(tree) == {".gitignore", "keep.log", "a/.gitignore", "a/top-only.txt", "a/a.log", "local.txt",
                           "src/main.py"}


def test_exclude_patterns_win_over_gitignore_and_gitignore_can_be_off(tmp_path):
    write(tmp_path, {".gitignore": "*.log\n", "run.log": "", "debug.log": "", "data/x.bin": "", "main.py": "",
                     ".git/HEAD": ""})
    tree = scan(SyncConfig(src=str(tmp_path), exclude=("data/", "!run.log")))
    assert paths(tree) == {".gitignore", "run.log", "main.py"}
    tree = scan(SyncConfig(src=str(tmp_path), gitignore=False))
    assert paths(tree) == {".gitignore", "run.log", "debug.log", "data/x.bin", "main.py"}  # never .git


def test_links_are_kept_as_links_and_skipped_directories_left_out(tmp_path):
    write(tmp_path, {"real/f.txt": "x", "runs/job/log.txt": "", "exec.sh": "#!/bin/sh\n"})
    os.chmod(tmp_path / "exec.sh", 0o750)
    os.symlink("real", tmp_path / "alias")  # a link to a directory: not followed
    tree = scan(SyncConfig(src=str(tmp_path)), skip=[str(tmp_path / "runs")])
    by_path = {e.path: e for e in tree.entries}
    assert set(by_path) == {"real/f.txt", "exec.sh", "alias"}
    assert by_path["alias"].link == "real" and by_path["exec.sh"].mode == 0o750
    assert tree.size == len("x") + len("#!/bin/sh\n")


@pytest.mark.parametrize("rel, ok", [("a/b.txt", True), ("../x", False), ("/etc/passwd", False), ("a/../../x", False),
                                     ("a//b", False), ("", False), ("./a", False), ("a\0b", False)])
def test_the_agent_writes_only_inside_the_destination(rel, ok):
    assert node_sync.safe_relpath(rel) is ok


def local_plan(tmp_path: Path, *workdirs: str):
    nodes = "".join(f"  - {{host: n{i}, gpus: 1{', workdir: ' + w if w else ''}}}\n" for i, w in enumerate(workdirs))
    cfg = parse_cluster(f"transport: local\npython: {sys.executable}\nnodes:\n{nodes}", str(tmp_path / "c.yaml"))
    return make_plan(cfg, "t.py", [], "j", str(tmp_path / "cwd"))


def test_every_node_needs_a_workdir_and_a_local_one_that_is_the_source_needs_nothing(tmp_path):
    tree = Tree(str(tmp_path / "cwd"), ())
    plan = make_plan(parse_cluster("nodes: [{host: a, gpus: 1, workdir: /w}, {host: b, gpus: 1}]\n", "c.yaml"),
                     "t.py", [], "j", "/")
    with pytest.raises(ConfigError, match=r"c.yaml:1: nodes\[1\]: sync copies into each node's `workdir:`"):
        targets(plan, tree.root, "c.yaml")
    # local nodes run in the current directory: syncing it onto itself, or twice, is skipped
    assert targets(local_plan(tmp_path, "", ""), tree.root, "c.yaml") == []
    assert sync_all(lambda: tree, [], no_bar).render() == f"sync {tree.root}: every node's workdir is this directory; nothing to copy"
    assert len(targets(local_plan(tmp_path, str(tmp_path / "d"), str(tmp_path / "d")), tree.root, "c.yaml")) == 1


def no_bar(total, nodes):
    return transfer_progress(Console(file=io.StringIO()), total, nodes)


def test_a_large_file_arrives_whole_with_its_time_and_mode_and_twice_means_once(tmp_path):
    src = tmp_path / "src"
    write(src, {"small.txt": "s"})
    (src / "big.bin").write_bytes(os.urandom(3 * 1024 * 1024 + 17))  # several chunks
    dest = tmp_path / "dest"
    tree = scan(SyncConfig(src=str(src)))
    summary = sync_all(lambda: tree, targets(local_plan(tmp_path, str(dest)), tree.root, "c.yaml"), no_bar)
    assert summary.nodes[0].files == 2 and summary.nodes[0].bytes == tree.size
    assert (dest / "big.bin").read_bytes() == (src / "big.bin").read_bytes()
    assert os.stat(dest / "big.bin").st_mtime_ns == os.stat(src / "big.bin").st_mtime_ns
    assert not [p for p in os.listdir(dest) if "ddp-up" in p]  # no temp file left
    again = sync_all(lambda: tree, targets(local_plan(tmp_path, str(dest)), tree.root, "c.yaml"), no_bar)
    assert again.nodes[0].need == [] and "nothing to copy" in again.render()


def test_a_path_leaving_the_destination_is_refused_by_the_node(tmp_path):
    tree = Tree(str(tmp_path), (Entry("../escape.txt", 1, 0, 0o644),))
    with pytest.raises(SetupError, match=r"n0: cannot sync into .*refusing path '\.\./escape\.txt'"):
        sync_all(lambda: tree, targets(local_plan(tmp_path, str(tmp_path / "dest")), tree.root, "c.yaml"), no_bar)
    assert not (tmp_path / "escape.txt").exists()


def test_the_nodes_connect_while_the_tree_is_scanned_and_a_failed_scan_stops_them(tmp_path, monkeypatch):
    """The agent starts during the scan (a connection is most of a small copy's time); a scan
    that fails is the error raised, and the agent that was waiting for the tree ends."""
    import time

    from orchestrator.errors import UsageError

    monkeypatch.setenv(MARK, str(tmp_path))  # its agents, not a parallel test's (a local agent inherits it)

    def scan_that_fails() -> Tree:
        deadline = time.monotonic() + 30
        while not agents_running(tmp_path):  # the node's agent is up before the tree is known
            assert time.monotonic() < deadline, "no agent started during the scan"
            time.sleep(0.01)
        raise UsageError("sync: cannot read /src/secret: Permission denied")

    syncs = targets(local_plan(tmp_path, str(tmp_path / "dest")), str(tmp_path / "src"), "c.yaml")
    with pytest.raises(UsageError, match="cannot read /src/secret"):
        sync_all(scan_that_fails, syncs, no_bar)
    deadline = time.monotonic() + 10
    while agents_running(tmp_path):
        assert time.monotonic() < deadline, agents_running(tmp_path)
        time.sleep(0.05)
    assert not (tmp_path / "dest").exists()  # the agent never got a spec, so it wrote nothing


def test_the_progress_bar_is_for_large_copies_on_a_terminal():
    out = io.StringIO()
    with transfer_progress(Console(file=out, force_terminal=True), LARGE, 4) as advance:
        advance(LARGE // 2)
    assert "sync" in out.getvalue() and "to 4 node(s)" in out.getvalue()
    quiet = io.StringIO()
    with transfer_progress(Console(file=quiet, force_terminal=True), LARGE - 1, 4) as advance:
        advance(1)
    assert quiet.getvalue() == ""


def test_a_node_agent_whose_controller_goes_silent_drops_its_partial_file_and_exits(tmp_path):
    """A partition closes nothing: the agent must not wait forever on a half-sent file."""
    import subprocess

    from orchestrator.node.protocol import wire

    spec = wire.SyncSpec(dest=str(tmp_path / "dest"), entries=[["big.bin", 10, 0, 0o644, None]], idle_timeout=1.0)
    proc = subprocess.Popen([sys.executable, "-u", *protocol.bootstrap_args()], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)
    try:
        proc.stdin.write(b"".join(protocol.hello(spec)))
        proc.stdin.flush()
        assert wire.Decoder().feed(proc.stdout.readline()) == [wire.Needs(str(tmp_path / "dest"), [0], ANY)]
        proc.stdin.write(wire.File(index=0, size=10, mtime_ns=0).encode() + b"abc")  # 3 of 10 bytes, then silence with the pipe still open
        proc.stdin.flush()
        assert proc.wait(timeout=15) == 3
    finally:
        proc.kill()
        proc.stdin.close()
        proc.stdout.close()
    assert os.listdir(tmp_path / "dest") == []


def test_links_replace_what_is_in_their_way_except_a_directory(tmp_path):
    src, dest = tmp_path / "src", tmp_path / "dest"
    write(src, {"a.txt": "a"})
    os.symlink("a.txt", src / "was-file")
    os.symlink("a.txt", src / "was-link")
    write(dest, {"was-file": "old"})
    os.symlink("elsewhere", dest / "was-link")
    tree = scan(SyncConfig(src=str(src)))
    sync_all(lambda: tree, targets(local_plan(tmp_path, str(dest)), tree.root, "c.yaml"), no_bar)
    assert os.readlink(dest / "was-file") == "a.txt" and os.readlink(dest / "was-link") == "a.txt"
    os.unlink(dest / "was-file")
    (dest / "was-file").mkdir()
    with pytest.raises(SetupError, match=r"cannot write .*was-file.*\n.*fix: a file in the copy has the name of a dir"):
        sync_all(lambda: tree, targets(local_plan(tmp_path, str(dest)), tree.root, "c.yaml"), no_bar)
    assert [p for p in os.listdir(dest) if "ddp-up" in p] == []


def test_ctrl_c_mid_copy_leaves_no_partial_file_and_no_agent(tmp_path):
    """Interrupted while a large file is in flight: exit 130, the nodes drop their partial file."""
    import signal
    import time

    from tests.harness.runner import Launch

    src, dest = tmp_path / "src", tmp_path / "dest"
    src.mkdir()
    with open(src / "big.bin", "wb") as f:
        f.truncate(4 * 10**9)  # sparse: reads fast, takes seconds to copy
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"transport: local\npython: {sys.executable}\nnodes: [{{host: a, gpus: 1, workdir: {dest}}}]\n"
                   f"sync: {src}\n")
    launch = Launch([str(cfg), "t.py"], env={MARK: str(tmp_path)})
    try:
        deadline = time.monotonic() + 60
        while not (dest.exists() and os.listdir(dest)):  # the temp file appears: bytes are moving
            assert launch.proc.poll() is None and time.monotonic() < deadline, launch.output
            time.sleep(0.01)
        launch.signal(signal.SIGINT)
        assert launch.wait(30) == 130, launch.output
    finally:
        launch.proc.kill()
    assert "SIGINT before the job started; nothing was started" in launch.output
    deadline = time.monotonic() + 10
    while os.listdir(dest) or agents_running(tmp_path):  # the agent saw its input end, dropped the file, left
        assert time.monotonic() < deadline, (os.listdir(dest), agents_running(tmp_path))
        time.sleep(0.05)


MARK = "SYNC_TEST_MARK"  # in a test's agents' environment: a parallel test's agents are not its own


def agents_running(mark) -> list[int]:
    """The node agents this test started (by MARK), as their command lines show them."""
    found, mine = [], f"{MARK}={mark}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if protocol.AGENT_MARK.encode() not in f.read():
                    continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mine in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:
            pass
    return found


def test_a_shared_workdir_is_copied_once_through_the_first_node_that_has_it():
    from orchestrator.remote.sync import share_workdirs

    plan = make_plan(parse_cluster("workdir: ~/p\nnodes: [{host: a, gpus: 1}, {host: b, gpus: 1}, {host: c, gpus: 1}, "
                                   "{host: d, gpus: 1}]\n", "c.yaml"), "t.py", [], "j", "/")
    a, b, c, d = syncs = targets(plan, "/src", "c.yaml")
    for s, marker in zip(syncs, "ABCD"):
        s.marker, s.need = marker, [0]
    a.sees, c.sees = frozenset("C"), frozenset("D")  # a, c and d share one directory (seen either way)
    share_workdirs(syncs)
    assert [s.shares_with for s in syncs] == [None, None, a, a]
    assert [s.need for s in syncs] == [[0], [0], [], []]
