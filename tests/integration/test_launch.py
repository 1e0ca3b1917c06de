"""Issue 2: the whole path on real sshd nodes with real torchrun + gloo."""

from __future__ import annotations

import json
import re

import pytest

from tests.harness.runner import ddp_up, run_dir
from tests.integration.conftest import SCRIPT


@pytest.fixture(params=["openssh", "fabric"])
def cluster_file(request, cluster_file):
    """Every launch test runs over both SSH clients: the user's own ssh, and paramiko; but for
    those marked ONE_CLIENT, whose subject (the ranks' layout, the root cause) an SSH client
    cannot change."""

    def make(layout, **top):
        return cluster_file(layout, ssh={"client": request.param, **top.pop("ssh", {})}, **top)

    return make


# torchrun costs 2-3 s of CPU a node on a 2-core machine: paid once, not per client
ONE_CLIENT = pytest.mark.parametrize("cluster_file", ["openssh"], indirect=True)


def ranks_ready(output: str) -> dict[int, str]:
    """{global rank: 'label rN' prefix} for every READY line; asserts no rank reports twice."""
    seen: dict[int, str] = {}
    for m in re.finditer(r"^(\S+)\s+r(\d+)\s+\| READY rank=(\d+) world=(\d+)", output, re.M):
        label, prefix_rank, rank = m.group(1), int(m.group(2)), int(m.group(3))
        assert prefix_rank == rank, f"prefix says r{prefix_rank} for rank {rank}"
        assert rank not in seen, f"rank {rank} reported twice"
        seen[rank] = label
    return seen


def test_two_nodes_two_procs(cluster, cluster_file):
    path = cluster_file([(0, 2), (1, 2)])
    code, out, _ = ddp_up(str(path), SCRIPT, "run", "--steps", "2")
    assert code == 0, out
    a, b = cluster.nodes[0].addr, cluster.nodes[1].addr
    assert ranks_ready(out) == {0: a, 1: a, 2: b, 3: b}
    assert re.search(rf"^{re.escape(b)}\s+r3\s+\| step 1 rank=3$", out, re.M), out
    assert re.search(r"│ 1\s+│ \S+\s+│ 2-3\s+│ done\s+│ 0", out), out


@ONE_CLIENT
def test_four_nodes_two_procs(cluster, cluster_file):
    path = cluster_file([(0, 2), (1, 2), (2, 2), (3, 2)])
    code, out, _ = ddp_up(str(path), SCRIPT, "run", "--steps", "1")
    assert code == 0, out
    ready = ranks_ready(out)
    assert sorted(ready) == list(range(8))
    assert [ready[r] for r in (0, 2, 4, 6)] == [n.addr for n in cluster.nodes]


@ONE_CLIENT
def test_heterogeneous_one_plus_three(cluster, cluster_file):
    path = cluster_file([(0, 1), (1, 3)])
    code, out, _ = ddp_up(str(path), SCRIPT, "run", "--steps", "1")
    assert code == 0, out
    a, b = cluster.nodes[0].addr, cluster.nodes[1].addr
    assert ranks_ready(out) == {0: a, 1: b, 2: b, 3: b}
    assert "world=4" in out


@ONE_CLIENT
def test_failing_rank_names_node_and_rank(cluster, cluster_file):
    path = cluster_file([(0, 1), (1, 2)])
    code, out, _ = ddp_up(str(path), SCRIPT, "run", "--fail-rank", "2", "--exit-code", "3", "--steps", "50",
                          "--step-time", "0.2")
    assert code == 1, out
    b = re.escape(cluster.nodes[1].addr)
    assert re.search(rf"root cause: {b} \(node 1, rank 2\): rank 2 exited with code 3", out), out
    assert re.search(rf"^{b}\s+r2\s+! rank 2 failing with 3$", out, re.M), "stderr line not marked"


@ONE_CLIENT
def test_the_root_cause_is_the_rank_that_raised_first_with_its_exception(cluster, cluster_file):
    """Issue 26, item 1: rank 1 raises; gloo aborts ranks 0 and 2, which raise too, and node 0's
    launcher may well report first. The root cause is rank 1's, with its exception, and its
    torchelastic error file is kept in the run's logs."""
    path = cluster_file([(0, 1), (1, 2)])
    code, out, _ = ddp_up(str(path), SCRIPT, "run", "--raise-rank", "1")
    assert code == 1, out
    b = re.escape(cluster.nodes[1].addr)
    assert re.search(rf"root cause: {b} \(node 1, rank 1\): rank 1 exited with code 1: RuntimeError: boom from "
                     r"rank 1$", out, re.M), out
    job = re.search(r"job (\S+):", out).group(1)
    summary = json.loads((run_dir(job) / "summary.json").read_text())
    assert summary["root_cause"]["exception"] == "RuntimeError: boom from rank 1", summary
    assert summary["root_cause"]["traceback"][-1] == "RuntimeError: boom from rank 1"
    assert [n["state"] for n in summary["nodes"]] == ["failed", "failed"]  # node 0's rank failed by itself too
    kept = json.loads((run_dir(job) / "rank1.error.json").read_text())
    assert kept["message"]["message"] == "RuntimeError: boom from rank 1"


HOSTILE = ["two words", "it's", 'say "hi"', "$(touch /tmp/ddp-up-pwned)", "; rm -rf /", "`id`",
           "naïve ✓ 日本", "--flag=x", "", "*", "a\\b", "$HOME", "new\nline"]


def test_hostile_script_args_arrive_verbatim(cluster, cluster_file, tmp_path):
    path = cluster_file([(0, 1), (1, 1)])
    code, out, _ = ddp_up(str(path), SCRIPT, "argv", *HOSTILE)
    assert code == 0, out
    line = next(l for l in out.splitlines() if "| ARGV " in l)
    assert json.loads(line.split("| ARGV ", 1)[1]) == HOSTILE


def test_unknown_host_key_is_refused(cluster, cluster_file, tmp_path):
    other_known = tmp_path / "known_hosts"
    other_known.write_text("")
    path = cluster_file([(0, 1), (1, 1)], ssh={"known_hosts": str(other_known)})
    code, out, _ = ddp_up(str(path), SCRIPT, "run")
    assert code == 3, out
    assert "unknown host key (ssh-ed25519 SHA256:" in out
    assert f"ssh-keyscan {cluster.nodes[0].addr} >> {other_known}" in out
    assert "nothing was started" in out


def test_unreachable_node_fails_within_connect_timeout(cluster, cluster_file):
    path = cluster_file([(0, 1), (1, 1)], launcher="none")  # the subject is the reach: no torch on the node that answers
    text = path.read_text().replace(cluster.nodes[1].addr, f"{cluster.net}.200")  # no such node
    path.write_text(text.replace("connect_timeout: 5", "connect_timeout: 2"))
    code, out, seconds = ddp_up(str(path), SCRIPT, "tick", "1", "0")
    assert code == 3, out
    gone = re.escape(f"{cluster.net}.200")
    # No answer (ARP unresolved), or no route at once (an unresolved ARP entry the kernel still holds)
    assert re.search(rf"{gone}: (no answer from root@{gone}:22 within 2 s|cannot reach root@{gone}:22: No route to "
                     "host)", out), out
    assert seconds < 2 + 8, f"took {seconds:.1f} s"


def test_missing_python_script_and_workdir_are_named(cluster, cluster_file, tmp_path):
    path = cluster_file([(0, 1), (1, 1), (2, 1)])
    text = path.read_text()
    text = text.replace(f"- host: {cluster.nodes[1].addr}\n  gpus: 1",
                        f"- host: {cluster.nodes[1].addr}\n  gpus: 1\n  python: /nope/python3")
    text = text.replace(f"- host: {cluster.nodes[2].addr}\n  gpus: 1",
                        f"- host: {cluster.nodes[2].addr}\n  gpus: 1\n  workdir: /nope/dir")
    path.write_text(text)
    code, out, _ = ddp_up(str(path), "missing.py")
    assert code == 3, out
    assert re.search(rf"{cluster.nodes[0].addr}: script missing.py not found in ", out), out
    assert f"{cluster.nodes[1].addr}: python not found: '/nope/python3'" in out
    assert f"{cluster.nodes[2].addr}: workdir /nope/dir does not exist" in out
