"""Issue 14 (first part): `ssh: {client: openssh}` runs the agent over the user's own ssh, so any
setup where plain `ssh -o BatchMode=yes HOST true` works works. Each config here works with ssh
by hand; the cluster files name nothing but aliases."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from tests.harness.runner import ddp_up
from tests.integration.conftest import SCRIPT


def write_config(cluster, path: Path, known_hosts: Path, *, extra: str = "", per_node=lambda node: "") -> Path:
    """An ssh_config naming every node by its alias, with what ssh needs to reach it."""
    blocks = [f"Host {n.name}\n  HostName {n.addr}\n{per_node(n)}" for n in cluster.nodes]
    common = (f"Host *\n  User root\n  IdentityFile {cluster.client_key}\n  UserKnownHostsFile {known_hosts}\n"
              "  GlobalKnownHostsFile /dev/null\n")
    path.write_text(extra + "\n".join(blocks) + common)
    return path


def cluster_file(tmp_path: Path, config: Path, hosts: list[str]) -> Path:
    doc = {"ssh": {"client": "openssh", "config_file": str(config), "connect_timeout": 5},
           "python": sys.executable, "workdir": str(tmp_path), "env": {"OMP_NUM_THREADS": 1},
           "nodes": [{"host": h, "gpus": 1} for h in hosts]}
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def ranks_ran(out: str, n: int) -> bool:
    return all(f"ENV RANK={r}" in out for r in range(n))


def plain_ssh_works(config: Path, host: str) -> bool:
    return subprocess.run(["ssh", "-F", str(config), "-o", "BatchMode=yes", host, "true"], capture_output=True,
                          timeout=30).returncode == 0


def test_settings_only_in_the_ssh_config_are_honoured(cluster, tmp_path):
    config = write_config(cluster, tmp_path / "ssh_config", cluster.known_hosts)
    hosts = [n.name for n in cluster.nodes[:2]]
    assert plain_ssh_works(config, hosts[0])
    code, out, _ = ddp_up(str(cluster_file(tmp_path, config, hosts)), SCRIPT, "env", "RANK")
    assert code == 0 and ranks_ran(out, 2), out
    assert f"master {cluster.nodes[0].addr}:" in out, out  # the alias's HostName, from `ssh -G`


def test_an_unknown_host_key_is_refused_by_default(cluster, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    config = write_config(cluster, tmp_path / "ssh_config", empty)
    host = cluster.nodes[0].name
    code, out, _ = ddp_up(str(cluster_file(tmp_path, config, [host])), SCRIPT, "env", "RANK")
    assert code == 3, out
    assert f"{host}: unknown host key for {host}; refusing to connect" in out, out
    assert f"ssh-keyscan {host} >> ~/.ssh/known_hosts" in out, out
    assert empty.read_text() == ""


def test_accept_new_in_the_users_config_records_new_keys(cluster, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    config = write_config(cluster, tmp_path / "ssh_config", empty, extra="Host *\n  StrictHostKeyChecking accept-new\n")
    hosts = [n.name for n in cluster.nodes[:2]]
    code, out, _ = ddp_up(str(cluster_file(tmp_path, config, hosts)), SCRIPT, "env", "RANK")
    assert code == 0 and ranks_ran(out, 2), out
    recorded = empty.read_text()
    assert all(n.addr in recorded for n in cluster.nodes[:2]), recorded


def test_proxy_command_and_proxy_jump(cluster, tmp_path):
    jump = cluster.nodes[0].name

    def via(node) -> str:
        if node.index == 3:
            return f"  ProxyCommand ssh -F {tmp_path / 'ssh_config'} -W %h:%p {jump}\n"
        if node.index == 4:
            return f"  ProxyJump {jump}\n"
        return ""

    config = write_config(cluster, tmp_path / "ssh_config", cluster.known_hosts, per_node=via)
    hosts = [cluster.nodes[2].name, cluster.nodes[3].name]
    assert all(plain_ssh_works(config, h) for h in hosts)
    code, out, _ = ddp_up(str(cluster_file(tmp_path, config, hosts)), SCRIPT, "env", "RANK")
    assert code == 0 and ranks_ran(out, 2), out


def test_include_and_match_blocks(cluster, tmp_path):
    (tmp_path / "nodes.conf").write_text("".join(f"Host {n.name}\n  HostName {n.addr}\n" for n in cluster.nodes))
    prefix = cluster.nodes[0].name[:-1]
    config = tmp_path / "ssh_config"
    config.write_text(f"Include {tmp_path / 'nodes.conf'}\n"
                      f"Match originalhost {prefix}*\n  User root\n  IdentityFile {cluster.client_key}\n"
                      f"  UserKnownHostsFile {cluster.known_hosts}\n  GlobalKnownHostsFile /dev/null\n")
    hosts = [n.name for n in cluster.nodes[:2]]
    code, out, _ = ddp_up(str(cluster_file(tmp_path, config, hosts)), SCRIPT, "env", "RANK")
    assert code == 0 and ranks_ran(out, 2), out


def test_hashed_known_hosts(cluster, tmp_path):
    hashed = tmp_path / "known_hosts"
    hashed.write_text(cluster.known_hosts.read_text())
    subprocess.run(["ssh-keygen", "-q", "-H", "-f", str(hashed)], check=True, capture_output=True, timeout=30)
    assert cluster.nodes[0].addr not in hashed.read_text()  # only hashes now
    config = write_config(cluster, tmp_path / "ssh_config", hashed)
    code, out, _ = ddp_up(str(cluster_file(tmp_path, config, [cluster.nodes[0].name])), SCRIPT, "env", "RANK")
    assert code == 0 and ranks_ran(out, 1), out


def test_ssh_failures_are_named_with_their_fix(cluster, tmp_path):
    config = write_config(cluster, tmp_path / "ssh_config", cluster.known_hosts,
                          per_node=lambda n: "  Port 2\n" if n.index == 2 else "")
    hosts = [cluster.nodes[0].name, cluster.nodes[1].name]
    code, out, _ = ddp_up(str(cluster_file(tmp_path, config, hosts)), SCRIPT, "env", "RANK")
    assert code == 3, out
    assert f"{hosts[1]}: connection refused by {hosts[1]}" in out and "fix: start sshd on the node" in out, out
    assert "ENV RANK" not in out


def accepted_logins(cluster, node) -> int:
    log = cluster.run_dir / f"{node.name}.log"
    return log.read_text().count("Accepted publickey") if log.exists() else 0


def test_one_ssh_handshake_per_node_per_run_and_nothing_left_after_it(cluster, tmp_path):
    """`gpus: auto` asks each node first (one agent call), then the job runs its agent there: both
    over one connection, whose master ends with the run."""
    config = write_config(cluster, tmp_path / "ssh_config", cluster.known_hosts)
    nodes = cluster.nodes[:2]
    path = cluster_file(tmp_path, config, [n.name for n in nodes])
    doc = yaml.safe_load(path.read_text())
    doc["gpus"] = "auto"
    doc["env"]["CUDA_VISIBLE_DEVICES"] = "0"  # what `gpus: auto` counts on a node without a driver
    for node in doc["nodes"]:
        del node["gpus"]
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    before = [accepted_logins(cluster, n) for n in nodes]
    code, out, _ = ddp_up(str(path), SCRIPT, "env", "RANK")
    assert code == 0 and ranks_ran(out, 2), out
    assert [accepted_logins(cluster, n) - b for n, b in zip(nodes, before)] == [1, 1]
    left = subprocess.run(["pgrep", "-f", "ddp-up-ssh-"], capture_output=True, text=True).stdout
    assert left == "", f"ssh masters left running: {left}"
    assert not list(Path(tempfile.gettempdir()).glob("ddp-up-ssh-*"))
