"""Issue 7 (SSH config): hosts as ~/.ssh/config aliases, and a node reachable only via ProxyJump."""

from __future__ import annotations

import re
import sys

import yaml

from tests.harness.runner import ddp_up
from tests.integration.conftest import SCRIPT

HIDDEN_PORT = 2222


def write_cluster(tmp_path, cluster, nodes: list[dict], config: str, known_hosts: str):
    (tmp_path / "ssh_config").write_text(config)
    (tmp_path / "known_hosts").write_text(known_hosts)
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({
        "nodes": nodes,
        "ssh": {"config_file": str(tmp_path / "ssh_config"), "known_hosts": str(tmp_path / "known_hosts"),
                "connect_timeout": 5},
        "python": sys.executable, "workdir": str(tmp_path), "env": {"OMP_NUM_THREADS": 1, "TICK_SAYS_WORLD": 1},
        "launcher": "none"}))  # ssh is the subject, not torchrun (see conftest.cluster_file); tick says each world
    return path


def test_aliases_from_an_ssh_config_file(cluster, tmp_path):
    a, b = cluster.nodes[0], cluster.nodes[1]
    config = (f"Host trainer-a\n  HostName {a.addr}\nHost trainer-b\n  HostName {b.addr}\n"
              f"Host trainer-*\n  User root\n  IdentityFile {cluster.client_key}\n")
    path = write_cluster(tmp_path, cluster, [{"host": "trainer-a", "gpus": 1}, {"host": "trainer-b", "gpus": 1}],
                         config, cluster.known_hosts.read_text())
    code, out, _ = ddp_up(str(path), SCRIPT, "tick", "1", "0")
    assert code == 0, out
    # The nodes cannot resolve the aliases: the master address must be the alias's HostName.
    assert re.search(rf"master {re.escape(a.addr)}:\d+", out), out
    assert re.search(r"trainer-b +r1 +\| WORLD 2 rank=1 ", out), out


def test_a_node_behind_a_jump_host(cluster, tmp_path):
    jump = cluster.nodes[2]
    cluster.start_loopback_sshd(jump, HIDDEN_PORT)  # only reachable from inside the jump node
    config = (f"Host hidden\n  HostName 127.0.0.1\n  Port {HIDDEN_PORT}\n  ProxyJump root@{jump.addr}\n"
              f"Host *\n  User root\n  IdentityFile {cluster.client_key}\n")
    nodes = [{"host": cluster.nodes[0].addr, "gpus": 1}, {"host": "hidden", "gpus": 1, "addr": jump.addr}]
    hidden_key = cluster.host_key_line(f"[127.0.0.1]:{HIDDEN_PORT}")
    path = write_cluster(tmp_path, cluster, nodes, config, cluster.known_hosts.read_text() + hidden_key)
    code, out, _ = ddp_up(str(path), SCRIPT, "tick", "1", "0")
    assert code == 0, out
    assert re.search(r"hidden +r1 +\| WORLD 2 rank=1 ", out), out
    # The workdir copy goes the same way (each node has its own workdir: the namespaces share a disk).
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "hello.py").write_text("print('HELLO from the copy', flush=True)\n")
    doc = yaml.safe_load(path.read_text())
    doc["sync"] = str(tmp_path / "src")
    for node, workdir in zip(doc["nodes"], ("wd-a", "wd-hidden")):
        node["workdir"] = str(tmp_path / workdir)
    path.write_text(yaml.safe_dump(doc))
    code, out, _ = ddp_up(str(path), "hello.py")
    assert code == 0 and "copied 1 file(s)" in out and "to each of 2 node(s)" in out, out
    assert re.search(r"hidden +r1 +\| HELLO from the copy", out), out
    # The jump host's key is checked like any node's: without it, refuse, and say which host.
    known = "".join(line + "\n" for line in cluster.known_hosts.read_text().splitlines()
                    if not line.startswith(jump.addr + " "))
    path = write_cluster(tmp_path, cluster, nodes, config, known + hidden_key)
    code, out, _ = ddp_up(str(path), SCRIPT, "tick", "1", "0")
    assert code == 3, out
    assert f"hidden: unknown host key of jump host {jump.addr}" in out and "WORLD" not in out, out
