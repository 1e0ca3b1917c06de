"""The OpenSSH client transport's pure parts: the ssh command line, and ssh's words -> a problem."""

from __future__ import annotations

import os
import tempfile
import socket
import struct
import threading
from pathlib import Path

import pytest

from orchestrator.remote import openssh, sshmaster
from orchestrator.config.clusterfile import parse_cluster
from orchestrator.remote.openssh import Inspection, ssh_args, ssh_failure


def node(ssh: str = ""):
    return parse_cluster(f"ssh: {{client: openssh{ssh}}}\nnodes: [{{host: gpu-a, gpus: 1}}]\n", "/etc/c.yaml").nodes[0]


@pytest.fixture
def run(tmp_path, monkeypatch):
    """The run's private directory under tmp_path (however long its path: the socket's room is
    tested on its own below); closed (and so removed) after the test."""
    monkeypatch.setattr(sshmaster.tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(sshmaster, "SOCKET_PATH_MAX", 4096)
    yield sshmaster.CONTROL
    sshmaster.CONTROL.close()


def test_a_long_tmpdir_leaves_the_control_sockets_room(tmp_path, monkeypatch):
    """Issue 26: ssh binds ControlPath + a 17-character suffix, and a Unix socket's path has 104
    bytes: a TMPDIR a little longer than usual made every node fail. The run's directory then
    goes where a socket path fits; a short TMPDIR is used as before."""
    long = tmp_path / ("t" * (sshmaster.SOCKET_PATH_MAX - len(str(tmp_path))))
    long.mkdir()
    monkeypatch.setattr(sshmaster.tempfile, "tempdir", str(long))
    parent = sshmaster.run_parent()
    assert parent != str(long) and len(parent) + len(f"/ddp-up-ssh-{os.getpid()}-") + 8 + 58 <= 104
    try:
        path = next(o for o in sshmaster.CONTROL.options(parse_cluster(
            "nodes: [{host: a, gpus: 1}]\n").nodes[0]) if o.startswith("ControlPath="))[len("ControlPath="):]
        assert len(path.replace("%C", "c" * 40)) + 17 <= 104 and os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o700
    finally:
        sshmaster.CONTROL.close()
    short = tempfile.mkdtemp(prefix="s", dir="/tmp")  # /tmp/sXXXXXXXX: room enough
    try:
        monkeypatch.setattr(sshmaster.tempfile, "tempdir", short)
        assert sshmaster.run_parent() == short
    finally:
        os.rmdir(short)


def test_only_what_the_cluster_file_sets_is_added_to_the_users_ssh(run, tmp_path):
    assert ssh_args(node())[1:] == ["-T", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]
    assert ssh_args(node(", user: me, port: 2222, config_file: /dev/null"))[1:] == [
        "-F", "/dev/null", "-T", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-l", "me", "-p", "2222"]
    assert not list(tmp_path.iterdir())  # nothing to write for that


def test_the_cluster_files_key_and_known_hosts_reach_every_hop_through_a_config_file(run, tmp_path):
    (tmp_path / "my config").write_text("")
    mine = tmp_path / "my config"
    args = ssh_args(node(f", user: me, identity_file: k, known_hosts: kh, config_file: {mine}"))
    assert args[1] == "-F" and args[3:] == ["-T", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-l", "me"]
    config = Path(args[2])
    assert config.parent.parent == tmp_path and config.parent.stat().st_mode & 0o777 == 0o700
    assert config.read_text().splitlines()[1:] == [
        "BatchMode yes", 'UserKnownHostsFile "/etc/kh"', 'IdentityFile "/etc/k"', f'Include "{mine}"']
    assert ssh_args(node(f", identity_file: k, known_hosts: kh, config_file: {mine}"))[2] == str(config)
    without = ssh_args(node(", known_hosts: kh"))[2]
    assert without != str(config) and Path(without).read_text().splitlines()[-2:] == [
        "Include ~/.ssh/config", "Include /etc/ssh/ssh_config"]
    run.close()
    assert not config.parent.exists()


def test_a_killed_runs_directory_is_removed_by_the_next_run_and_nothing_else_is(run, tmp_path):
    dead = tmp_path / "ddp-up-ssh-999999999-abc"  # no such pid
    alive = tmp_path / f"ddp-up-ssh-{os.getpid()}-abc"
    other = tmp_path / "ddp-up-ssh-notours"
    for d in (dead, alive, other):
        d.mkdir()
    (dead / "config0").write_text("")
    ssh_args(node(", known_hosts: kh"))
    assert not dead.exists() and alive.exists() and other.exists()


SEEN = Inspection("me@gpu-a:22", "10.0.0.1", "~/.ssh/known_hosts", "ssh-ed25519 SHA256:abc", "10.0.0.1:22")


@pytest.mark.parametrize("stderr, what, fix", [
    (["No ED25519 host key is known for gpu-a and you have requested strict checking.",
      "Host key verification failed."], "unknown host key (ssh-ed25519 SHA256:abc); refusing to connect",
     "ssh-keyscan 10.0.0.1 >> ~/.ssh/known_hosts"),
    (["@@@@@@@@", "@    WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED!     @", "Host key verification failed."],
     "host key for gpu-a CHANGED", "ssh-keygen -R 10.0.0.1 -f ~/.ssh/known_hosts"),
    (["Certificate invalid: name is not a listed principal", "Host key verification failed."],
     "the host certificate is not valid for it (name is not a listed principal)", "for the name ssh uses (10.0.0.1)"),
    (["ssh: connect to host 10.0.0.1 port 22: No route to host"], "cannot reach me@gpu-a:22: No route to host",
     "routing"),
    (["root@gpu-a: Permission denied (publickey)."], "SSH authentication failed for me@gpu-a:22", "authorized_keys"),
    (["ssh: Could not resolve hostname gpu-a: Name or service not known"], "cannot resolve host name 'gpu-a'",
     "DNS"),
    (["ssh: connect to host 10.0.0.1 port 22: Connection refused"], "connection refused by me@gpu-a:22",
     "start sshd"),
    (["ssh: connect to host 10.0.0.1 port 22: Connection timed out"], "no answer from me@gpu-a:22 within 10 s",
     "connect_timeout"),
    (["kex_exchange_identification: Connection closed by remote host"], "dropped the connection during the handshake",
     "max_parallel"),
    (["something new"], "ssh to gpu-a failed: something new", "ssh gpu-a true"),
    # issue 26, item 12: a socket ssh cannot bind is not an authentication failure
    (["unix_listener: cannot bind to path /x/ddp-up-ssh-1-abc/9f3a.k2J9: Permission denied"],
     "ssh could not make its shared connection's socket (unix_listener: cannot bind to path", "TMPDIR"),
    (['unix_listener: path "/very/long/ab12.Xy9" too long for Unix domain socket'],
     "shared connection's socket", "short, private, writable TMPDIR"),
    (["banner exchange: Connection to 10.0.0.1 port 22: invalid format"],
     "gpu-a did not answer as an SSH server (banner exchange", "`port:`"),
])
def test_ssh_failures_become_one_problem_and_its_fix(stderr, what, fix):
    problem = ssh_failure(node(), stderr, ask=lambda node, want_key: SEEN)
    assert problem.node == "gpu-a" and what in problem.what and fix in problem.fix


def test_an_unknown_key_of_a_jump_host_is_named_as_the_jump_hosts():
    seen = SEEN._replace(key_of="bastion:2222")
    problem = ssh_failure(node(), ["Host key verification failed.", "kex_exchange_identification: closed"],
                          ask=lambda node, want_key: seen)
    assert "unknown host key of jump host bastion (ssh-ed25519 SHA256:abc)" in problem.what
    assert "ssh-keyscan -p 2222 bastion >> ~/.ssh/known_hosts" in problem.fix


def test_a_jump_hosts_refusal_hidden_by_the_shared_master_is_asked_again():
    """Under ControlPersist ssh sends a ProxyJump hop's stderr to /dev/null: all that is left is
    kex_exchange_identification, which alone would read as a MaxStartups drop."""
    seen = SEEN._replace(key_of="bastion:22", said="Host key verification failed.\nkex_exchange_identification")
    problem = ssh_failure(node(), ["kex_exchange_identification: Connection closed by remote host"],
                          ask=lambda node, want_key: seen)
    assert "unknown host key of jump host bastion" in problem.what
    quiet = SEEN._replace(said="")  # it went through this time: it was the jump host's MaxStartups
    problem = ssh_failure(node(), ["kex_exchange_identification: Connection closed by remote host"],
                          ask=lambda node, want_key: quiet)
    assert "max_parallel" in problem.fix


@pytest.mark.parametrize("value, strict", [(None, "yes"), ("ask", "yes"), ("yes", "yes"), ("True", "yes"),
                                           ("accept-new", "accept-new"), ("no", "no"), ("off", "no"),
                                           ("false", "no")])
def test_strict_host_key_checking_as_openssh_reads_it_in_batch_mode(value, strict):
    from orchestrator.remote.paramiko_ssh import strictness

    assert strictness(value) == strict


def test_fabric_reads_the_known_hosts_files_the_ssh_config_names():
    from orchestrator.remote.paramiko_ssh import HostKeyTrust

    from_config = {"userknownhostsfile": "~/kh1 /etc/kh2", "globalknownhostsfile": "/dev/null",
                   "stricthostkeychecking": "accept-new", "hashknownhosts": "yes"}
    trust = HostKeyTrust.of(node().ssh, from_config)
    assert trust.files == (os.path.expanduser("~/kh1"), "/etc/kh2", "/dev/null")
    assert (trust.record_to, trust.strict, trust.hashed) == (os.path.expanduser("~/kh1"), "accept-new", True)
    assert HostKeyTrust.of(node(", known_hosts: kh").ssh, from_config).files == ("/etc/kh", "/dev/null")
    assert HostKeyTrust.of(node().ssh, {}).files == (
        os.path.expanduser("~/.ssh/known_hosts"), os.path.expanduser("~/.ssh/known_hosts2"),
        "/etc/ssh/ssh_known_hosts", "/etc/ssh/ssh_known_hosts2")


def _mux_server(path: str, answer) -> threading.Thread:
    """A unix socket that reads what a client sends and answers with ``answer(received)``."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)

    def serve() -> None:
        with server:
            conn, _ = server.accept()
            with conn:
                conn.settimeout(5)
                received = b""
                while len(received) < 24:  # hello (4+8) and terminate (4+8)
                    more = conn.recv(64)
                    if not more:
                        break
                    received += more
                conn.sendall(answer(received))
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_a_master_is_asked_to_exit_as_ssh_O_exit_asks_it(tmp_path):
    seen = []

    def master(received: bytes) -> bytes:
        seen.append(received)
        return sshmaster._mux_packet(sshmaster.MUX_HELLO, 4) + sshmaster._mux_packet(sshmaster.MUX_OK, 1)
    thread = _mux_server(str(tmp_path / "m"), master)
    assert sshmaster.end_master(str(tmp_path / "m"), timeout=5)
    thread.join(5)
    assert seen == [struct.pack(">IIIIII", 8, 1, 4, 8, 0x10000005, 1)]  # hello v4, then MUX_C_TERMINATE


@pytest.mark.parametrize("answer", [
    lambda _: b"",  # closes without a word
    lambda _: sshmaster._mux_packet(sshmaster.MUX_HELLO, 4) + sshmaster._mux_packet(0x80000002, 1) + b"\0\0\0\0",  # denied
    lambda _: b"\xff\xff\xff\xff",  # a length no master sends
])
def test_anything_but_a_masters_yes_is_not_taken_for_one(tmp_path, answer):
    thread = _mux_server(str(tmp_path / "m"), answer)
    assert not sshmaster.end_master(str(tmp_path / "m"), timeout=5)
    thread.join(5)
    assert not sshmaster.end_master(str(tmp_path / "gone"), timeout=1)  # no socket at all


DEFAULT = "chacha20-poly1305@openssh.com,aes128-ctr,aes192-ctr,aes256-ctr,aes128-gcm@openssh.com,aes256-gcm@openssh.com"


@pytest.mark.parametrize("aes, configured, expected", [
    (True, DEFAULT, "aes128-gcm@openssh.com,aes256-gcm@openssh.com,chacha20-poly1305@openssh.com,aes128-ctr,"
                    "aes192-ctr,aes256-ctr"),  # OpenSSH's choice: the same ciphers, AES-GCM first
    (True, "chacha20-poly1305@openssh.com", None),  # the user's own choice is followed as written
    (False, DEFAULT, None),  # no AES instructions here: chacha20 is the faster one
])
def test_a_bulk_connection_prefers_aes_gcm_only_where_openssh_would_choose_and_the_cpu_has_aes(monkeypatch, aes,
                                                                                               configured, expected):
    monkeypatch.setattr(openssh, "_default_ciphers", lambda: DEFAULT)
    monkeypatch.setattr(openssh, "_has_aes", lambda: aes)
    monkeypatch.setattr(openssh, "resolved", lambda n: {"ciphers": configured})
    got = openssh.bulk_ciphers(node())
    assert got == ([] if expected is None else ["-o", f"Ciphers={expected}"])
    if expected is not None:
        assert sorted(expected.split(",")) == sorted(DEFAULT.split(","))  # nothing added, nothing taken away


@pytest.mark.parametrize("host", ["r7n2$(touch${IFS}/tmp/pwned)", "a;rm -rf ~", "`id`", "x'y"])
def test_every_command_a_fix_suggests_is_quoted(host):
    """A host name (or a key's host, a known_hosts path) reaches a suggested command only quoted:
    pasting it runs what it says, nothing more."""
    import shlex

    from orchestrator.remote import sshproblems

    for fix in (sshproblems.unknown_key("n", None, None, ("-p", "2222", host), f"~/{host}").fix,
                sshproblems.changed_key("n", host, host, f"/k/{host}").fix):
        line = fix.split(": ", 1)[1].split(" (or set")[0].split(", then")[0]
        words = shlex.split(line.replace(">>", "").replace("~/", "HOME/"))
        assert host in words or f"HOME/{host}" in words, (line, words)
    from dataclasses import replace

    problem = openssh._described(replace(node(), host=host), "some odd failure", lambda *_: None)
    assert shlex.split(problem.fix[len("run `"):problem.fix.rindex("`")]) == ["ssh", host, "true"], problem.fix
