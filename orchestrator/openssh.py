"""The user's own OpenSSH client as a transport: ``ssh -T -o BatchMode=yes -- HOST COMMAND``.

If ``ssh HOST`` works, this works: every setting the user's ssh honours applies (config files,
Include and Match, ProxyJump and ProxyCommand, known-hosts files, StrictHostKeyChecking, host
certificates, the agent), because ssh itself applies it. ddp-up adds only what the cluster file
says (user, port, identity file, known_hosts, connect timeout, config file) and BatchMode, so
nothing ever prompts. The agent's protocol runs over the pipes of the ssh process exactly as the
local transport runs over a subprocess's; what ddp-up needs to know itself (the address other
nodes use) comes from ``ssh -G``.

With no setting anywhere, an unknown host key is refused: OpenSSH's default is to ask, and
BatchMode turns asking into refusing.
"""

from __future__ import annotations

import shutil
import subprocess
from typing import Mapping, Sequence

from .config import NodeConfig
from .errors import NodeProblem
from .transport import ConnectFailed, LocalProcess, RemoteProcess, Transport, remote_command

G_TIMEOUT = 10.0  # `ssh -G` only reads config files


def ssh_args(node: NodeConfig) -> list[str]:
    """ssh and its options for ``node``, up to (not including) ``-- HOST``."""
    ssh = node.ssh
    args = [shutil.which("ssh") or "ssh"]
    if ssh.config_file:
        args += ["-F", ssh.config_file]
    args += ["-T", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={max(1, round(ssh.connect_timeout))}"]
    if ssh.user:
        args += ["-l", ssh.user]
    if ssh.port:
        args += ["-p", str(ssh.port)]
    if ssh.identity_file:
        args += ["-i", ssh.identity_file]
    if ssh.known_hosts_set:
        args += ["-o", f"UserKnownHostsFile={ssh.known_hosts}"]
    return args


class OpenSSHTransport(Transport):
    """Nothing to open ahead: ssh connects when the agent starts, and a failure to connect is its
    exit status 255 with its reason on stderr (see ``ssh_failure``)."""

    def connect(self) -> None:
        pass

    def start(self, python: str, bootstrap_args: list[str], tags: Mapping[str, str],
              setup: tuple[str, ...] = (), workdir: str | None = None) -> RemoteProcess:
        command = remote_command(python, bootstrap_args, tags, setup, workdir)
        argv = [*ssh_args(self.node), "--", self.node.host, command]
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True)  # Ctrl-C reaches ddp-up only
        except OSError as e:
            raise ConnectFailed(NodeProblem(self.node.label, f"cannot run ssh: {e.strerror}",
                                            "install the OpenSSH client, or set `ssh: {client: fabric}`")) from None
        return LocalProcess(proc)


def resolved(node: NodeConfig) -> dict[str, str]:
    """What ssh would use for ``node`` (``ssh -G``): hostname, user, port, ... ({} if it cannot say)."""
    argv = [*ssh_args(node), "-G", "--", node.host]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=G_TIMEOUT, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return {}
    if out.returncode != 0:
        return {}
    found = {}
    for line in out.stdout.splitlines():
        key, _, value = line.partition(" ")
        found.setdefault(key, value)
    return found


# ssh's own words (stderr) -> one problem and its fix. First match wins.
_FAILURES = (
    ("REMOTE HOST IDENTIFICATION HAS CHANGED", "host key for {host} CHANGED (possible impersonation); refusing",
     "if the node was reinstalled, remove the old key (ssh-keygen -R {host}) and add the new one after checking it"),
    ("Host key verification failed", "unknown host key for {host}; refusing to connect (BatchMode: no prompts)",
     "check the key's fingerprint with the node's admin, then add it: ssh-keyscan {keyscan} >> ~/.ssh/known_hosts "
     "(or set `StrictHostKeyChecking accept-new` for it in your SSH config)"),
    ("Permission denied", "SSH authentication failed for {host} (no password prompts)",
     "check `user:`/`identity_file:` or your SSH config, ssh-agent, and the node's authorized_keys"),
    ("Could not resolve hostname", "cannot resolve host name {host!r}",
     "fix `host:` or add it to DNS, /etc/hosts or your SSH config"),
    ("Connection refused", "connection refused by {host}", "start sshd on the node or fix the port"),
    ("timed out", "no answer from {host} within the connect timeout",
     "check the address, the network path and that sshd runs; or raise ssh.connect_timeout"),
    ("kex_exchange_identification", "the SSH server (or a jump host in front of it) dropped the connection "
     "during the handshake", "too many connections at once through one host (sshd's MaxStartups): raise it "
                            "there, or launch fewer nodes at once"),
    ("Connection closed by", "the SSH server (or a jump host in front of it) closed the connection",
     "try `ssh HOST true` by hand to see why"),
)


def ssh_failure(node: NodeConfig, stderr_tail: Sequence[str]) -> NodeProblem:
    """Why ssh exited 255 before the agent answered, from its last stderr lines."""
    text = "\n".join(stderr_tail)
    port = f"-p {node.ssh.port} " if node.ssh.port else ""
    for needle, what, fix in _FAILURES:
        if needle in text:
            fill = {"host": node.host, "keyscan": f"{port}{node.host}"}
            return NodeProblem(node.label, what.format(**fill), fix.format(**fill))
    last = next((line for line in reversed(stderr_tail) if line.strip()), "no message")
    return NodeProblem(node.label, f"ssh to {node.host} failed: {last}", f"run `ssh {node.host} true` to see why")


def ssh_hostname(node: NodeConfig) -> str:
    """The address ssh connects to for ``node`` (an alias's HostName), as other nodes need it."""
    return resolved(node).get("hostname", node.host)
