"""ddp-fetch and the `fetch:` key against hostile and careless input: every byte lands at or under
LOCAL_DIR/<node>/<name>, both names made safe by ddp-up and distinct for every node; no link
below LOCAL_DIR is followed; a stop removes what was half written. A real local agent each time."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from orchestrator.commands.fetch import main_fetch
from orchestrator.config.clusterfile import parse_cluster
from orchestrator.errors import ConfigError, Interrupted
from orchestrator.remote import fetch as fetch_mod
from orchestrator.remote import signals
from orchestrator.remote.fetch import fetch_all, fetch_folders

from .test_fetch import checkpoint, nodes


@pytest.fixture(autouse=True)
def no_signal_yet(monkeypatch):
    """The process's one signal inbox, empty for each test and as it was after it."""
    monkeypatch.setattr(signals.INBOX, "received", [])


def every_file(top: Path) -> list[Path]:
    return [p for p in top.rglob("*") if not p.is_dir() or p.is_symlink()]


def cluster_file(tmp_path: Path, hosts: list[str]) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(f"transport: local\npython: {sys.executable}\nworkdir: {tmp_path / 'wd'}\nnodes:\n"
                    + "".join(f"  - {{{h}, gpus: 1}}\n" for h in hosts))
    return path


@pytest.mark.parametrize("remote", ["..", "ckpt/../..", ".", "./", "/", "//", "~", "~/", "~root", "ckpt/..", " .. "])
def test_a_path_that_names_no_file_of_its_own_is_refused_and_nothing_is_made(tmp_path, capsys, remote):
    checkpoint(tmp_path)
    out = tmp_path / "parent" / "out"
    for node_option in ([], ["--node", "0"]):
        assert main_fetch([str(cluster_file(tmp_path, ["host: a", "host: b"])), remote, str(out), *node_option]) == 2
        err = capsys.readouterr().err
        assert "names no file or folder of its own" in err and "Traceback" not in err
    assert not (tmp_path / "parent").exists()  # refused before LOCAL_DIR was made


@pytest.mark.parametrize("paths", ["['/']", "[.]", "[ckpt/..]", "['~']", "[a/ckpt, b/ckpt]"])
def test_the_fetch_key_refuses_the_same_paths_and_two_paths_that_land_as_one(paths):
    with pytest.raises(ConfigError) as e:
        parse_cluster(f"transport: local\npython: python3\nfetch: {paths}\nnodes: [{{host: a, gpus: 1}}]\n")
    assert "fetch" in str(e.value) and ("of its own" in str(e.value) or "would both come back as <node>/ckpt" in str(e.value))


@pytest.mark.parametrize("label", ["../../x", "..", ".", "a/b", "/etc", "~", "$(id)", "a:b", "n" * 255, ".hidden"])
def test_a_hostile_node_label_becomes_a_safe_folder_inside_local_dir(tmp_path, label):
    ck = checkpoint(tmp_path)
    out = tmp_path / "deep" / "out"
    out.mkdir(parents=True)
    fetched = fetch_all(nodes(tmp_path, hosts=[f'host: "{label}"', "host: n1"]), "ckpt", str(out), per_node=True)
    assert [f.problem for f in fetched] == [None, None], fetched
    folders = sorted(p.name for p in out.iterdir())
    assert len(folders) == 2 and all(not f.startswith(".") and len(f.encode()) <= 200 for f in folders), folders
    for f in folders:
        assert (out / f / "ckpt" / "model.pt").read_bytes() == (ck / "model.pt").read_bytes()
    assert sorted(p.name for p in (tmp_path / "deep").iterdir()) == ["out"]  # nothing beside LOCAL_DIR
    assert sorted(p.name for p in tmp_path.iterdir()) == ["deep", "wd"]


def test_two_nodes_with_one_label_each_get_a_folder_and_both_copies_come_whole(tmp_path):
    ck = checkpoint(tmp_path)
    same = nodes(tmp_path, hosts=["host: a, port: 2201", "host: a, port: 2202", "host: a_b", 'host: "a:b"'])
    assert fetch_folders(same) == {0: "a-node0", 1: "a-node1", 2: "a_b-node2", 3: "a_b-node3"}
    fetched = fetch_all(same, "ckpt", str(tmp_path / "out"), per_node=True)
    assert [f.problem for f in fetched] == [None] * 4 and len({f.dest for f in fetched}) == 4
    for f in fetched:
        assert (Path(f.dest) / "model.pt").read_bytes() == (ck / "model.pt").read_bytes() and f.files == 2


@pytest.mark.parametrize("planted", ["n0", "n0/ckpt", "n0/ckpt/sub"])
def test_a_link_anywhere_below_local_dir_is_never_written_through(tmp_path, planted):
    checkpoint(tmp_path)
    elsewhere, out = tmp_path / "elsewhere", tmp_path / "out"
    elsewhere.mkdir()
    (out / planted).parent.mkdir(parents=True, exist_ok=True)
    os.symlink(elsewhere, out / planted)
    fetched = fetch_all(nodes(tmp_path, 2), "ckpt", str(out), per_node=True)
    assert fetched[0].problem is not None and "is a symbolic link here, and fetch never writes through one" in \
        fetched[0].problem.what and str(out / planted) in fetched[0].problem.what
    assert fetched[1].problem is None  # the other node's copy is its own
    assert list(elsewhere.iterdir()) == []


def test_local_dir_itself_may_be_a_link_the_user_named(tmp_path):
    checkpoint(tmp_path)
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "out")
    [got] = fetch_all(nodes(tmp_path), "ckpt", str(tmp_path / "out"), per_node=False)
    assert got.problem is None and (tmp_path / "real" / "ckpt" / "model.pt").is_file()


def test_a_file_where_the_node_has_a_folder_is_named_in_the_message(tmp_path):
    checkpoint(tmp_path)
    (tmp_path / "out" / "ckpt").mkdir(parents=True)
    (tmp_path / "out" / "ckpt" / "sub").write_text("mine")
    [got] = fetch_all(nodes(tmp_path), "ckpt", str(tmp_path / "out"), per_node=False)
    assert got.problem is not None and f"{tmp_path}/out/ckpt/sub is a file here, where the node has a folder" in got.problem.what
    assert (tmp_path / "out" / "ckpt" / "sub").read_text() == "mine"


def test_a_file_and_a_link_with_the_longest_names_come_back(tmp_path):
    ck = tmp_path / "wd" / "ckpt"
    ck.mkdir(parents=True)
    longest = "f" * 255
    (ck / longest).write_bytes(b"x" * 10)
    os.symlink(longest, ck / ("l" * 255))
    [got] = fetch_all(nodes(tmp_path), "ckpt", str(tmp_path / "out"), per_node=False)
    assert got.problem is None and (got.files, got.links) == (1, 1), got
    assert (tmp_path / "out" / "ckpt" / longest).read_bytes() == b"x" * 10
    assert os.readlink(tmp_path / "out" / "ckpt" / ("l" * 255)) == longest


def test_a_sparse_file_keeps_its_holes(tmp_path):
    ck = tmp_path / "wd" / "ckpt"
    ck.mkdir(parents=True)
    with open(ck / "sparse.bin", "wb") as f:
        f.seek(3 << 20)
        f.write(b"data")
        f.truncate(9 << 20)  # a hole, data, a hole at the end
    [got] = fetch_all(nodes(tmp_path), "ckpt", str(tmp_path / "out"), per_node=False)
    copy = tmp_path / "out" / "ckpt" / "sparse.bin"
    assert got.problem is None and copy.read_bytes() == (ck / "sparse.bin").read_bytes()
    assert os.stat(copy).st_size == 9 << 20 and os.stat(copy).st_blocks * 512 < 2 << 20, os.stat(copy)


def test_a_stop_while_copying_leaves_no_partial_file_and_no_writer(tmp_path, monkeypatch):
    ck = tmp_path / "wd" / "ckpt"
    ck.mkdir(parents=True)
    for i in range(2):
        (ck / f"big{i}.pt").write_bytes(os.urandom(24 << 20))
    real_write, stops = fetch_mod.write_keeping_holes, []

    def slow_write(fd, data):
        real_write(fd, data)
        if not stops:
            stops.append(1)
            signals.INBOX.post(signal.SIGINT)  # Ctrl-C, once the first bytes are on disk
        time.sleep(0.01)

    monkeypatch.setattr(fetch_mod, "write_keeping_holes", slow_write)
    out = tmp_path / "out"
    with signals.recording(), pytest.raises(Interrupted):
        fetch_all(nodes(tmp_path, 2), "ckpt", str(out), per_node=True)
    assert stops and not [p for p in every_file(out) if ".ddp-up-fetch" in p.name]  # at once, as it is raised
    deadline = time.monotonic() + 30
    while any(t.name.startswith("fetch-") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = every_file(out)
    assert not [p for p in left if ".ddp-up-fetch" in p.name], left  # and no writer made one later
    assert all(p.stat().st_size == 24 << 20 for p in left), left  # what is there is whole


def test_ddp_fetch_says_the_truth_after_a_stop(tmp_path, capsys, monkeypatch):
    checkpoint(tmp_path)
    monkeypatch.setattr(fetch_mod, "write_keeping_holes", lambda fd, data: signals.INBOX.post(signal.SIGTERM))
    code = main_fetch([str(cluster_file(tmp_path, ["host: a"])), "ckpt", str(tmp_path / "out")])
    assert code == 128 + signal.SIGTERM
    assert "no partial file is left" in capsys.readouterr().err
    assert not [p for p in every_file(tmp_path / "out") if ".ddp-up-fetch" in p.name]
