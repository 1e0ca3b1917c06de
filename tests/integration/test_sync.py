"""Issue 7: `sync:` copies a local tree to every node's workdir over SSH, changed files only."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import yaml

from tests.harness.runner import ddp_up
from tests.integration.conftest import SCRIPT

COPIED = {"job.py", ".gitignore", "keep.log", "pkg/model.py", "pkg/.gitignore", "pkg/public.txt", "latest"}


def make_tree(src: Path) -> None:
    """A project as users have them: ignored data and logs, a nested .gitignore, a negation, a
    link, an executable script, a .git directory, and a file only the `exclude:` list drops."""
    (src / "pkg").mkdir(parents=True)
    (src / "data").mkdir()
    (src / ".git").mkdir()
    shutil.copy(SCRIPT, src / "job.py")
    os.chmod(src / "job.py", 0o755)
    (src / ".gitignore").write_text("data/\n*.log\n!keep.log\n")
    (src / "pkg" / ".gitignore").write_text("secret.txt\n")
    (src / "pkg" / "model.py").write_text("W = 1\n")
    (src / "pkg" / "public.txt").write_text("p\n")
    (src / "pkg" / "secret.txt").write_text("s\n")
    (src / "data" / "shard0.bin").write_bytes(os.urandom(4096))
    (src / "run.log").write_text("old run\n")
    (src / "keep.log").write_text("kept\n")
    (src / "scratch.tmp").write_text("excluded by the cluster file\n")
    (src / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    os.symlink("pkg/model.py", src / "latest")


def tree_of(root: Path) -> dict[str, tuple[int, int]]:
    """relative path -> (inode, mtime) of every file and link under root."""
    found = {}
    for here, _dirs, files in os.walk(root):
        for name in files:
            st = os.lstat(os.path.join(here, name))
            found[os.path.relpath(os.path.join(here, name), root)] = (st.st_ino, st.st_mtime_ns)
    return found


def sync_cluster(cluster, tmp_path: Path, src: Path) -> tuple[Path, list[Path]]:
    """Two nodes, each with its own workdir (the namespaces share this machine's disk)."""
    dests = [tmp_path / f"node{i}" / "project" for i in range(2)]
    path = cluster.cluster_file(tmp_path / "cluster.yaml", [(cluster.nodes[0], 1), (cluster.nodes[1], 1)],
                                python=sys.executable, env={"OMP_NUM_THREADS": 1}, launcher="none",  # see conftest.cluster_file
                                sync={"src": str(src), "exclude": ["*.tmp"]})
    doc = yaml.safe_load(path.read_text())
    for node, dest in zip(doc["nodes"], dests):
        node["workdir"] = str(dest)  # does not exist yet: the copy creates it
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path, dests


def test_sync_copies_what_git_would_then_only_what_changed(cluster, tmp_path):
    src = tmp_path / "src"
    make_tree(src)
    path, dests = sync_cluster(cluster, tmp_path, src)

    code, out, _ = ddp_up(str(path), "job.py", "env", "RANK")  # the script itself arrives by the copy
    assert code == 0, out
    assert "copied 6 file(s)" in out and "to each of 2 node(s)" in out, out
    for dest in dests:
        assert set(tree_of(dest)) == COPIED
        assert os.readlink(dest / "latest") == "pkg/model.py"
        assert os.stat(dest / "job.py").st_mode & 0o777 == 0o755
        assert (dest / "pkg" / "model.py").read_text() == "W = 1\n"
    first = [tree_of(d) for d in dests]

    code, out, _ = ddp_up(str(path), "job.py", "env", "RANK")
    assert code == 0, out
    assert "nothing to copy, all unchanged on 2 node(s)" in out, out
    assert [tree_of(d) for d in dests] == first  # not one file rewritten (same inodes, same times)

    (src / "pkg" / "model.py").write_text("W = 2  # edited\n")
    (dests[1] / "checkpoint.pt").write_text("written by the job")  # only on the node: must survive
    code, out, _ = ddp_up(str(path), "job.py", "env", "RANK")
    assert code == 0, out
    assert "copied 1 file(s)" in out, out
    for dest, before in zip(dests, first):
        after = tree_of(dest)
        assert (dest / "pkg" / "model.py").read_text() == "W = 2  # edited\n"
        assert {k for k in COPIED if after[k] != before[k]} == {"pkg/model.py"}
    assert (dests[1] / "checkpoint.pt").exists()


def test_a_node_that_cannot_take_the_copy_is_named_and_nothing_starts(cluster, tmp_path):
    src = tmp_path / "src"
    make_tree(src)
    path, dests = sync_cluster(cluster, tmp_path, src)
    dests[1].parent.mkdir(parents=True)
    dests[1].write_text("a file where the workdir should be")
    code, out, _ = ddp_up(str(path), "job.py", "env", "RANK")
    assert code == 3, out
    assert f"{cluster.nodes[1].addr}: cannot sync into {dests[1]}: File exists" in out, out
    assert "fix: a file is in the way of the workdir" in out, out
    assert "ENV RANK" not in out


def test_nodes_sharing_one_workdir_get_one_copy(cluster, tmp_path):
    """Two nodes whose workdir is one directory (the namespaces share this disk, as NFS homes do):
    one of them receives the copy, the other nothing, and no marker is left behind."""
    src = tmp_path / "src"
    make_tree(src)
    path, _ = sync_cluster(cluster, tmp_path, src)
    shared = tmp_path / "shared" / "project"
    doc = yaml.safe_load(path.read_text())
    for node in doc["nodes"]:
        node["workdir"] = str(shared)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    code, out, _ = ddp_up(str(path), "job.py", "env", "RANK")
    assert code == 0, out
    assert "copied 6 file(s)" in out and "to each of 1 node(s); 1 more share a workdir" in out, out
    assert set(tree_of(shared)) == COPIED  # and no .ddp-up-sync-* marker
