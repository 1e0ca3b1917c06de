"""Issue 14: 64 nodes behind one jump host whose sshd keeps the default `MaxStartups 10:30:100`.
Plain parallel ssh loses connections there; ddp-up's bounded connection starts (ssh.max_parallel,
default 10) must get every node."""

from __future__ import annotations

import os
import signal
import sys

import pytest
import yaml

from tests.harness.runner import ddp_up
from tests.harness.sshcluster import SSHCluster, available
from tests.integration.conftest import SCRIPT
from tests.integration.test_openssh import write_config

NODES = 64


@pytest.fixture(scope="module")
def big_cluster(tmp_path_factory):
    if available():
        pytest.skip(available())
    c = SSHCluster(NODES + 1, tmp_path_factory.mktemp("bigcluster"))  # a subnet no other cluster holds
    try:
        yield c.up()
    finally:
        c.down()


def test_64_nodes_behind_one_jump_host_with_default_max_startups(big_cluster, tmp_path):
    jump, nodes = big_cluster.nodes[0], big_cluster.nodes[1:]
    config_path = big_cluster.run_dir / f"{jump.name}.sshd_config"
    config_path.write_text(config_path.read_text().replace("MaxStartups 200:30:400", "MaxStartups 10:30:100"))
    os.kill(int((big_cluster.run_dir / f"{jump.name}.pid").read_text()), signal.SIGHUP)  # sshd re-reads it
    ssh_config = write_config(big_cluster, tmp_path / "ssh_config", big_cluster.known_hosts,
                              per_node=lambda n: f"  ProxyJump {jump.name}\n" if n is not jump else "")
    doc = {"ssh": {"client": "openssh", "config_file": str(ssh_config), "connect_timeout": 30},
           "python": sys.executable, "workdir": str(tmp_path), "launcher": "none", "orphan_timeout": 120,
           "nodes": [{"host": n.name, "gpus": 1} for n in nodes]}
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    code, out, _ = ddp_up("--no-dashboard", str(path), SCRIPT, "env", "RANK", timeout=300)
    assert code == 0, out[-3000:]
    assert all(f"ENV RANK={r}" in out for r in range(NODES)), out[-3000:]
