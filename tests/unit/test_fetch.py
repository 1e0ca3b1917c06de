"""ddp-fetch: files back from the nodes, with a real local agent (the same agent and channel as over
SSH): changed files only, links as links, planted FIFOs and local links, a full disk."""

from __future__ import annotations

import errno
import os
import sys
import time
from pathlib import Path

import pytest

from orchestrator.remote import fetch as fetch_mod
from orchestrator.config.clusterfile import parse_cluster
from orchestrator.commands.fetch import main_fetch
from orchestrator.remote.fetch import fetch_all, landing_parts
from orchestrator.node.files import fetch as node_fetch
from orchestrator.node.protocol import wire


def nodes(tmp_path: Path, count: int = 1, hosts: list | None = None) -> list:
    """Local nodes on this machine's tmp_path/wd: n0, n1, ... or ``hosts`` (flow mappings' items)."""
    hosts = hosts or [f"host: n{i}" for i in range(count)]
    text = (f"transport: local\npython: {sys.executable}\nworkdir: {tmp_path / 'wd'}\nnodes:\n"
            + "".join(f"  - {{{host}, gpus: 1}}\n" for host in hosts))
    return list(parse_cluster(text).nodes)


def checkpoint(tmp_path: Path) -> Path:
    ck = tmp_path / "wd" / "ckpt"
    (ck / "sub").mkdir(parents=True)
    (ck / "model.pt").write_bytes(os.urandom(3 << 20))  # more than one Chunk
    (ck / "sub" / "opt.pt").write_bytes(b"state")
    os.chmod(ck / "sub" / "opt.pt", 0o640)
    os.symlink("../model.pt", ck / "sub" / "latest")
    os.symlink("/etc/passwd", ck / "outside")  # a link out of the tree: kept as a link, never read
    os.mkfifo(ck / "planted")  # never opened: a FIFO would hold a reader
    return ck


def test_a_folder_comes_back_whole_then_only_what_changed(tmp_path):
    ck = checkpoint(tmp_path)
    out = tmp_path / "out"
    [first] = fetch_all(nodes(tmp_path), "ckpt", str(out), per_node=False)
    assert first.problem is None and (first.files, first.links) == (2, 2), first
    assert (out / "ckpt" / "model.pt").read_bytes() == (ck / "model.pt").read_bytes()
    assert os.stat(out / "ckpt" / "sub" / "opt.pt").st_mode & 0o777 == 0o640
    assert os.stat(out / "ckpt" / "model.pt").st_mtime_ns // 10**9 == os.stat(ck / "model.pt").st_mtime_ns // 10**9
    assert os.readlink(out / "ckpt" / "outside") == "/etc/passwd" and os.readlink(out / "ckpt" / "sub" / "latest") == "../model.pt"
    assert first.left_out == ["planted (not a regular file)"] and not (out / "ckpt" / "planted").exists()
    [again] = fetch_all(nodes(tmp_path), "ckpt", str(out), per_node=False)
    assert (again.files, again.bytes, again.unchanged) == (0, 0, 4), again  # nothing sent twice
    (ck / "sub" / "opt.pt").write_bytes(b"newer state")
    [third] = fetch_all(nodes(tmp_path), "ckpt", str(out), per_node=False)
    assert (third.files, third.bytes) == (1, len(b"newer state")) and (out / "ckpt" / "sub" / "opt.pt").read_bytes() == b"newer state"
    assert not [p for p in out.rglob("*") if ".ddp-up-fetch" in p.name]


def test_every_node_gets_a_folder_of_its_own_and_one_file_comes_alone(tmp_path):
    checkpoint(tmp_path)
    fetched = fetch_all(nodes(tmp_path, 2), "ckpt/sub/opt.pt", str(tmp_path / "out"), per_node=True)
    assert [f.problem for f in fetched] == [None, None]
    for label in ("n0", "n1"):
        assert (tmp_path / "out" / label / "opt.pt").read_bytes() == b"state"
    assert landing_parts("/abs/ckpt/", None) == ("ckpt",) and landing_parts("ckpt", "n1") == ("n1", "ckpt")


def test_a_full_disk_is_one_clear_error_and_leaves_no_partial_file(tmp_path, monkeypatch):
    checkpoint(tmp_path)
    real_write, written = os.write, []

    def full_disk(fd, data):
        if written:
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(len(data))
        return real_write(fd, data)

    monkeypatch.setattr(fetch_mod.os, "write", full_disk)
    [got] = fetch_all(nodes(tmp_path), "ckpt", str(tmp_path / "out"), per_node=False)
    assert got.problem is not None and "No space left on device" in got.problem.what, got
    assert "free space on this machine's disk" in got.problem.fix
    assert not (tmp_path / "out" / "ckpt" / "model.pt").exists()  # nothing half written looks whole
    assert not [p for p in (tmp_path / "out").rglob("*") if ".ddp-up-fetch" in p.name]


def test_nothing_is_written_through_a_link_already_in_the_local_folder(tmp_path):
    checkpoint(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "out" / "ckpt").mkdir(parents=True)
    os.symlink(elsewhere, tmp_path / "out" / "ckpt" / "sub")  # planted where the node's sub/ goes
    [got] = fetch_all(nodes(tmp_path), "ckpt", str(tmp_path / "out"), per_node=False)
    assert got.problem is not None and "is a symbolic link here, and fetch never writes through one" in got.problem.what
    assert list(elsewhere.iterdir()) == []


def test_a_path_missing_on_a_node_or_a_folder_that_cannot_be_made_is_one_message(tmp_path, capsys):
    cluster = tmp_path / "c.yaml"
    cluster.write_text(f"transport: local\npython: {sys.executable}\nworkdir: {tmp_path}\nnodes: [{{host: a, gpus: 1}}]\n")
    assert main_fetch([str(cluster), "no/such", str(tmp_path / "out")]) == 3
    out = capsys.readouterr().out
    assert f"a: cannot read {tmp_path}/no/such: No such file or directory" in out and "Traceback" not in out
    assert main_fetch([str(cluster), "x", "/proc/no-folder-here"]) == 2
    assert "cannot make /proc/no-folder-here" in capsys.readouterr().err
    assert main_fetch([str(cluster), "x", str(tmp_path), "--node", "zz"]) == 2
    assert "--node 'zz': no such node; the nodes are 0 (a)" in capsys.readouterr().err


def test_the_node_never_opens_a_fifo_and_never_follows_a_link(tmp_path):
    ck = checkpoint(tmp_path)
    entries, left_out = node_fetch.listing(str(ck))
    assert sorted(e[0] for e in entries) == ["model.pt", "outside", "sub/latest", "sub/opt.pt"]  # folders are implied
    assert [e[4] for e in entries if e[0] == "outside"] == ["/etc/passwd"] and left_out == ["planted (not a regular file)"]
    sent = []
    writer = type("W", (), {"send": lambda self, f, block=True: sent.append(f)})()
    started = time.monotonic()
    assert node_fetch.send_one(str(ck / "planted"), 7, writer) == -1  # not a regular file: not read, not waited on
    assert time.monotonic() - started < 5 and sent == [wire.Chunk(index=7, end=True, data=b"")]
    assert node_fetch.send_one(str(ck / "outside"), 8, writer) == -1  # O_NOFOLLOW: a link is never opened


def test_a_listing_with_a_path_out_of_the_folder_is_refused(tmp_path):
    call = fetch_mod.FetchCall(nodes(tmp_path)[0], "ckpt", str(tmp_path), ("ckpt",))
    call.landing = fetch_mod.Landing(str(tmp_path), ("ckpt",))
    call.entries = [["../../etc/cron.d/x", 1, 0, 0o644, None]]
    with pytest.raises(OSError, match="a path out of the folder"):
        call.plan()
