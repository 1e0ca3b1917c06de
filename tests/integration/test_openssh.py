"""Issue 14 (first part): `ssh: {client: openssh}` runs the agent over the user's own ssh, so any
setup where plain `ssh -o BatchMode=yes HOST true` works works. Each config here works with ssh
by hand; the cluster files name nothing but aliases."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from tests.harness.runner import Launch, ddp_up
from tests.integration.conftest import SCRIPT


def write_config(cluster, path: Path, known_hosts: Path, *, extra: str = "", per_node=lambda node: "") -> Path:
    """An ssh_config naming every node by its alias, with what ssh needs to reach it."""
    blocks = [f"Host {n.name}\n  HostName {n.addr}\n{per_node(n)}" for n in cluster.nodes]
    common = (f"Host *\n  User root\n  IdentityFile {cluster.client_key}\n  UserKnownHostsFile {known_hosts}\n"
              "  GlobalKnownHostsFile /dev/null\n")
    path.write_text(extra + "\n".join(blocks) + common)
    return path


def cluster_file(tmp_path: Path, config: Path, hosts: list[str], client: str = "openssh") -> Path:
    doc = {"ssh": {"client": client, "config_file": str(config), "connect_timeout": 5},
           "python": sys.executable, "workdir": str(tmp_path), "env": {"OMP_NUM_THREADS": 1},
           "launcher": "none",  # ssh is the subject, not torchrun (see conftest.cluster_file)
           "nodes": [{"host": h, "gpus": 1} for h in hosts]}
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def ranks_ran(out: str, n: int) -> bool:
    return all(f"ENV RANK={r}" in out for r in range(n))


def plain_ssh_works(config: Path, host: str) -> bool:
    return subprocess.run(["ssh", "-F", str(config), "-o", "BatchMode=yes", host, "true"], capture_output=True,
                          timeout=30).returncode == 0


BOTH = pytest.mark.parametrize("client", ["openssh", "fabric"])


@BOTH
def test_settings_only_in_the_ssh_config_are_honoured(cluster, tmp_path, client):
    config = write_config(cluster, tmp_path / "ssh_config", cluster.known_hosts)
    hosts = [n.name for n in cluster.nodes[:2]]
    assert plain_ssh_works(config, hosts[0])
    code, out, _ = ddp_up(str(cluster_file(tmp_path, config, hosts, client)), SCRIPT, "env", "RANK")
    assert code == 0 and ranks_ran(out, 2), out
    assert f"master {cluster.nodes[0].addr}:" in out, out  # the alias's HostName, from `ssh -G`


@BOTH
def test_an_unknown_host_key_is_refused_by_default(cluster, tmp_path, client):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    config = write_config(cluster, tmp_path / "ssh_config", empty)
    host = cluster.nodes[0].name
    code, out, _ = ddp_up(str(cluster_file(tmp_path, config, [host], client)), SCRIPT, "env", "RANK")
    assert code == 3, out
    assert f"{host}: unknown host key (ssh-ed25519 SHA256:" in out, out
    assert f"ssh-keyscan {cluster.nodes[0].addr} >> {empty}" in out, out  # the address ssh looks the key up by
    assert empty.read_text() == ""


@BOTH
def test_accept_new_in_the_users_config_records_new_keys(cluster, tmp_path, client):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    config = write_config(cluster, tmp_path / "ssh_config", empty, extra="Host *\n  StrictHostKeyChecking accept-new\n")
    hosts = [n.name for n in cluster.nodes[:2]]
    code, out, _ = ddp_up(str(cluster_file(tmp_path, config, hosts, client)), SCRIPT, "env", "RANK")
    assert code == 0 and ranks_ran(out, 2), out
    assert out.count("StrictHostKeyChecking accept-new for") == 1, out  # noted, once
    assert f"{hosts[0]}, {hosts[1]}: a host key seen for the first time is trusted" in out, out
    recorded = empty.read_text()
    assert all(n.addr in recorded for n in cluster.nodes[:2]), recorded
    code, out, _ = ddp_up(str(cluster_file(tmp_path, config, hosts, client)), SCRIPT, "env", "RANK")
    assert code == 0 and empty.read_text() == recorded, out  # known now: nothing recorded twice


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


@BOTH
def test_hashed_known_hosts(cluster, tmp_path, client):
    hashed = tmp_path / "known_hosts"
    hashed.write_text(cluster.known_hosts.read_text())
    subprocess.run(["ssh-keygen", "-q", "-H", "-f", str(hashed)], check=True, capture_output=True, timeout=30)
    assert cluster.nodes[0].addr not in hashed.read_text()  # only hashes now
    config = write_config(cluster, tmp_path / "ssh_config", hashed)
    code, out, _ = ddp_up(str(cluster_file(tmp_path, config, [cluster.nodes[0].name], client)), SCRIPT, "env",
                          "RANK")
    assert code == 0 and ranks_ran(out, 1), out


def test_ssh_failures_are_named_with_their_fix(cluster, tmp_path):
    config = write_config(cluster, tmp_path / "ssh_config", cluster.known_hosts,
                          per_node=lambda n: "  Port 2\n" if n.index == 2 else "")
    hosts = [cluster.nodes[0].name, cluster.nodes[1].name]
    code, out, _ = ddp_up(str(cluster_file(tmp_path, config, hosts)), SCRIPT, "env", "RANK")
    assert code == 3, out
    assert f"{hosts[1]}: connection refused by root@{hosts[1]}:2" in out and "fix: start sshd on the node" in out, out
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
    launch = Launch([str(path), SCRIPT, "env", "RANK"])
    code, out = launch.wait(120), launch.output
    assert code == 0 and ranks_ran(out, 2), out
    assert [accepted_logins(cluster, n) - b for n, b in zip(nodes, before)] == [1, 1]
    left = subprocess.run(["pgrep", "-f", f"ddp-up-ssh-{launch.proc.pid}-"], capture_output=True, text=True).stdout
    assert left == "", f"ssh masters left running: {left}"
    assert not list(Path(tempfile.gettempdir()).glob(f"ddp-up-ssh-{launch.proc.pid}-*"))


def test_a_long_tmpdir_does_not_break_the_shared_connections(cluster, tmp_path):
    """Issue 26: with a TMPDIR a little longer than usual, ssh's ControlPath socket (the path plus
    the suffix ssh binds it under) did not fit a Unix socket's path, and every node failed."""
    long_tmp = tmp_path / ("t" * 80)
    long_tmp.mkdir()
    config = write_config(cluster, tmp_path / "ssh_config", cluster.known_hosts)
    path = cluster_file(tmp_path, config, [n.name for n in cluster.nodes[:2]])
    launch = Launch([str(path), SCRIPT, "env", "RANK"], env={"TMPDIR": str(long_tmp)})
    code, out = launch.wait(120), launch.output
    assert code == 0 and ranks_ran(out, 2), out
    assert not list(long_tmp.iterdir())  # the run's directory went where its sockets fit, and is gone
    left = subprocess.run(["pgrep", "-f", f"ddp-up-ssh-{launch.proc.pid}-"], capture_output=True, text=True).stdout
    assert left == "", f"ssh masters left running: {left}"


def test_host_certificates_from_a_site_ca(cluster, tmp_path):
    """Sites with an SSH CA list the CA once (`@cert-authority`), not each node's key: a node whose
    certificate names it is trusted, one whose certificate names another host is refused."""
    ca = tmp_path / "ca"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(ca)], check=True, timeout=30)
    good, bad = cluster.nodes[0], cluster.nodes[1]
    for node, principal in ((good, good.addr), (bad, "somebody-else")):
        key = tmp_path / f"host-{node.name}"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True, timeout=30)
        subprocess.run(["ssh-keygen", "-q", "-s", str(ca), "-h", "-I", node.name, "-n", principal, f"{key}.pub"],
                       check=True, capture_output=True, timeout=30)
        cluster.start_sshd(node, f"{node.addr}:{CERT_PORT}", host_key=key, certificate=Path(f"{key}-cert.pub"))
    known = tmp_path / "known_hosts"
    known.write_text(f"@cert-authority * {Path(f'{ca}.pub').read_text()}")
    config = write_config(cluster, tmp_path / "ssh_config", known, per_node=lambda n: f"  Port {CERT_PORT}\n")
    assert plain_ssh_works(config, good.name) and not plain_ssh_works(config, bad.name)
    code, out, _ = ddp_up(str(cluster_file(tmp_path, config, [good.name])), SCRIPT, "env", "RANK")
    assert code == 0 and ranks_ran(out, 1), out
    code, out, _ = ddp_up(str(cluster_file(tmp_path, config, [good.name, bad.name])), SCRIPT, "env", "RANK")
    assert code == 3 and "ENV RANK" not in out, out
    assert f"{bad.name}: the host certificate is not valid for it (name is not a listed principal)" in out, out
    assert f"sign that host key for the name ssh uses ({bad.addr})" in out, out


CERT_PORT = 2223
