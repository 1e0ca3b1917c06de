"""The paramiko client (``ssh.client: paramiko``), through Fabric: the only module that imports
the SSH library, and only when a node is reached this way. Host keys are verified as OpenSSH
would (known_hosts, the user's StrictHostKeyChecking), never accepted silently.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import os
import socket
import threading
from typing import Mapping, NamedTuple

from ..config.cluster import NodeConfig, SSHSettings
from ..errors import NodeProblem
from . import sshproblems as problems
from .openssh import resolved
from .parallel import on_each
from .transport import CHUNK, ConnectFailed, RemoteProcess, Transport, remote_command

SYSTEM_KNOWN_HOSTS = "/etc/ssh/ssh_known_hosts /etc/ssh/ssh_known_hosts2"

class SSHProcess(RemoteProcess):
    def __init__(self, channel):
        self.channel = channel
        self._write_lock = threading.Lock()

    def read_stdout(self) -> bytes:
        try:
            return self.channel.recv(CHUNK)
        except (OSError, EOFError):
            return b""

    def read_stderr(self) -> bytes:
        try:
            return self.channel.recv_stderr(CHUNK)
        except (OSError, EOFError):
            return b""

    def write(self, data: bytes) -> None:
        with self._write_lock:
            if self.channel.closed:
                raise OSError("channel closed")
            self.channel.sendall(data)

    def exit_status(self, timeout: float) -> int | None:
        if self.channel.status_event.wait(timeout):
            return self.channel.exit_status
        return None

    def close(self) -> None:
        try:
            self.channel.shutdown_write()
        except (OSError, EOFError):
            pass
        self.channel.close()


class SSHTransport(Transport):
    """Fabric supplies connection settings, the SSH config (HostName, User, Port, IdentityFile,
    ProxyJump) and gateways; we add strict host keys on every hop and bounded timeouts."""

    def __init__(self, node: NodeConfig):
        super().__init__(node)
        self.conn = None

    def connect(self) -> None:
        import paramiko
        from fabric import Connection

        ssh = self.node.ssh
        conn = Connection(self.node.host, user=ssh.user, port=ssh.port, config=fabric_config(ssh),
                          connect_timeout=max(1, round(ssh.connect_timeout)))
        revoked: list = []
        for hop in _hops(conn):  # a jump host's key is checked as strictly as the node's own
            trust = HostKeyTrust.of(ssh, hop.ssh_config)
            for path in trust.files:
                revoked += load_known_hosts(hop.client.get_host_keys(), path, paramiko)
            # Fabric installs AutoAddPolicy; replace it before connecting: unknown keys are refused
            # unless the user's own SSH config says otherwise (StrictHostKeyChecking accept-new / no).
            hop.client.set_missing_host_key_policy(_UnknownHostPolicy(self.node, trust, jump=hop is not conn))
        try:
            conn.open()
            _refuse_revoked(self.node, conn, revoked)
        except Exception as e:  # noqa: BLE001 - every failure becomes one clear message
            conn.close()
            raise ConnectFailed(describe_connect_error(self.node, e, paramiko)) from None
        conn.transport.set_keepalive(5)
        self.conn = conn

    def start(self, python: str, bootstrap_args: list[str], tags: Mapping[str, str],
              setup: tuple[str, ...] = (), workdir: str | None = None) -> RemoteProcess:
        command = remote_command(python, bootstrap_args, tags, setup, workdir)
        channel = self.conn.transport.open_session(timeout=self.node.ssh.connect_timeout)
        channel.exec_command(command)
        return SSHProcess(channel)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


def fabric_config(ssh: SSHSettings):
    """Fabric settings every hop inherits (gateways are built from a clone): timeouts, and the
    cluster file's identity file, which OpenSSH would also offer to a jump host."""
    from fabric import Config

    kwargs = {"banner_timeout": ssh.connect_timeout, "auth_timeout": ssh.connect_timeout}
    if ssh.identity_file:
        kwargs["key_filename"] = [ssh.identity_file]
    overrides = {"timeouts": {"connect": max(1, round(ssh.connect_timeout))}, "connect_kwargs": kwargs}
    return Config(runtime_ssh_path=ssh.config_file, overrides=overrides)


def _hops(conn) -> list:
    """The connection and every ProxyJump gateway in front of it."""
    hops = [conn]
    while not isinstance(conn.gateway, (str, type(None))):
        conn = conn.gateway
        hops.append(conn)
    return hops


class HostFacts(NamedTuple):
    """What the SSH config says of one node's host, as ddp-up needs it before connecting."""

    hostname: str  # the address the alias stands for: what the other nodes can reach
    strict: str  # StrictHostKeyChecking, as ``strictness`` reads it


def ssh_facts(nodes: list[NodeConfig]) -> dict[str, HostFacts]:
    """Each SSH node's host -> what its SSH config says of it, asked of all nodes at once."""
    def facts(node: NodeConfig) -> HostFacts:
        if node.ssh.client == "openssh":
            found = resolved(node)  # `ssh -G`: Include, Match and all, as ssh reads them
        else:
            found = fabric_config(node.ssh).base_ssh_config.lookup(node.host)
        return HostFacts(found.get("hostname", node.host), strictness(found.get("stricthostkeychecking")))

    ssh_nodes = [n for n in nodes if n.transport == "ssh"]
    return dict(zip((n.host for n in ssh_nodes), on_each(ssh_nodes, facts, name="ssh-G")))


def load_known_hosts(keys, path: str, paramiko) -> list:
    """Add a known_hosts file's entries to ``keys`` (paramiko HostKeys), line by line as OpenSSH
    reads it: a line that does not parse is skipped, not fatal. Marker lines are not host keys:
    ``@revoked`` keys are returned (a node presenting one is refused); ``@cert-authority`` lines
    need certificate support, which this SSH client does not have (the `ssh` client does)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    revoked = []
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        marker = line.split(None, 1)[0] if line.startswith("@") else None
        try:
            entry = paramiko.hostkeys.HostKeyEntry.from_line(line.split(None, 1)[1] if marker else line)
        except (paramiko.hostkeys.InvalidHostKey, paramiko.SSHException, ValueError, IndexError):
            continue
        if entry is None:
            continue
        if marker == "@revoked":
            revoked.append(entry.key)
        elif marker is None:
            for name in entry.hostnames:
                keys.add(name, entry.key.get_name(), entry.key)
    return revoked


def _refuse_revoked(node: NodeConfig, conn, revoked: list) -> None:
    for hop in _hops(conn):
        key = hop.transport.get_remote_server_key() if hop.transport else None
        if key is not None and any(key == bad for bad in revoked):
            raise UnknownHostKey(NodeProblem(node.label, f"the host key of {hop.host} is marked @revoked in "
                                             "known_hosts; refusing to connect",
                                             "ask the node's admin for its new key"))


class UnknownHostKey(Exception):
    def __init__(self, problem: NodeProblem):
        super().__init__(problem.what)
        self.problem = problem


class HostKeyTrust(NamedTuple):
    """How OpenSSH would check one hop's host key, from the cluster file and the SSH config."""

    files: tuple[str, ...]  # known_hosts files to read: the user's, then the system's
    record_to: str  # where a key accepted under accept-new / no is written (the first user file)
    strict: str  # "yes" (refuse unknown keys; also OpenSSH's "ask" in batch mode), "accept-new" or "no"
    hashed: bool  # HashKnownHosts: record the host name hashed

    @classmethod
    def of(cls, ssh: SSHSettings, config: Mapping) -> HostKeyTrust:
        if ssh.known_hosts_set:
            user = [ssh.known_hosts]
        else:
            user = [os.path.expanduser(p) for p in config.get("userknownhostsfile", USER_KNOWN_HOSTS).split()]
        system = [os.path.expanduser(p) for p in config.get("globalknownhostsfile", SYSTEM_KNOWN_HOSTS).split()]
        return cls(tuple(user + system), user[0], strictness(config.get("stricthostkeychecking")),
                   str(config.get("hashknownhosts", "no")).lower() == "yes")


USER_KNOWN_HOSTS = "~/.ssh/known_hosts ~/.ssh/known_hosts2"


def strictness(value: object) -> str:
    """An SSH config's StrictHostKeyChecking as "yes", "accept-new" or "no" (unset: "yes", since
    OpenSSH asks, and in batch mode asking is refusing)."""
    word = str(value or "ask").lower()
    if word == "accept-new":
        return "accept-new"
    return "no" if word in ("no", "off", "false") else "yes"


_RECORD_LOCK = threading.Lock()


def record_host_key(trust: HostKeyTrust, hostname: str, key) -> None:
    """Append ``key`` for ``hostname`` to the user's known_hosts, as OpenSSH does under
    accept-new: created 0600 (its directory 0700) if missing, the name hashed if configured."""
    import paramiko

    name = paramiko.HostKeys.hash_host(hostname) if trust.hashed else hostname
    line = f"{name} {key.get_name()} {key.get_base64()}\n"
    with _RECORD_LOCK:
        os.makedirs(os.path.dirname(trust.record_to) or ".", mode=0o700, exist_ok=True)
        fd = os.open(trust.record_to, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "a") as f:
            f.write(line)


class _UnknownHostPolicy:
    """OpenSSH's StrictHostKeyChecking for a key no known_hosts file has: refuse (saying how to
    fix it), or, where the user's SSH config says accept-new or no, record it and go on. (A
    changed key is refused whatever the setting: paramiko raises before asking.)"""

    def __init__(self, node: NodeConfig, trust: HostKeyTrust, jump: bool = False):
        self.node = node
        self.trust = trust
        self.jump = jump  # the key belongs to a ProxyJump hop in front of the node

    def missing_host_key(self, client, hostname, key):
        if self.trust.strict in ("accept-new", "no"):
            record_host_key(self.trust, hostname, key)
            client.get_host_keys().add(hostname, key.get_name(), key)
            return
        digest = base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")
        host, _, port = hostname.lstrip("[").partition("]:")  # paramiko names a non-22 port "[host]:port"
        raise UnknownHostKey(problems.unknown_key(self.node.label, f"{key.get_name()} SHA256:{digest}",
                                                  host if self.jump else None,
                                                  ("-p", port, host) if port else (host,), self.trust.record_to))


def describe_connect_error(node: NodeConfig, e: Exception, paramiko) -> NodeProblem:
    """Map whatever the SSH stack raised to one reason and one fix."""
    ssh, label = node.ssh, node.label
    where = f"{ssh.user + '@' if ssh.user else ''}{node.host}:{ssh.port or 22}"
    if isinstance(e, UnknownHostKey):
        return e.problem
    if isinstance(e, paramiko.BadHostKeyException):
        return problems.changed_key(label, node.host, node.host, ssh.known_hosts)
    if isinstance(e, paramiko.PasswordRequiredException):
        return NodeProblem(label, "the identity file is passphrase-protected and no prompt is possible",
                           "load it into ssh-agent (ssh-add) or use an unencrypted key")
    if isinstance(e, paramiko.AuthenticationException):
        return problems.auth_failed(label, where)
    if isinstance(e, (socket.timeout, TimeoutError)):
        return problems.no_answer(label, where, ssh.connect_timeout)
    if isinstance(e, socket.gaierror):
        return problems.unresolvable(label, node.host)
    if isinstance(e, paramiko.ssh_exception.NoValidConnectionsError):  # one OSError per address tried
        e = next(iter(e.errors.values()), e)
    if isinstance(e, ConnectionRefusedError) or getattr(e, "errno", None) == errno.ECONNREFUSED:
        return problems.refused(label, where)
    if isinstance(e, OSError) and e.strerror:
        return problems.unreachable(label, where, e.strerror)
    return NodeProblem(label, f"SSH to {where} failed: {e}", "try `ssh` by hand to see the full error")
