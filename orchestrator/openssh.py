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
import tempfile
import threading
from typing import Mapping, Sequence

from .config import NodeConfig
from .errors import NodeProblem
from .transport import ConnectFailed, LocalProcess, RemoteProcess, Transport, remote_command

G_TIMEOUT = 10.0  # `ssh -G` only reads config files
PERSIST = 60  # seconds an idle master stays up: if ddp-up dies without closing it, it ends by itself
EXIT_TIMEOUT = 5.0  # for `ssh -O exit`


class ControlSockets:
    """One SSH connection per node per run. Every ssh that ddp-up starts for a node (the `gpus:
    auto` probe, sync, the job's agent, sweeps) shares one ControlMaster, whose socket lives in
    a private directory of this run (mkdtemp: 0700, a fresh random name); ``close`` ends the
    masters and removes the directory."""

    def __init__(self) -> None:
        self.dir: str | None = None
        self.used: dict[str, NodeConfig] = {}
        self.lock = threading.Lock()

    def options(self, node: NodeConfig) -> list[str]:
        with self.lock:
            if self.dir is None:
                self.dir = tempfile.mkdtemp(prefix="ddp-up-ssh-")
            self.used.setdefault(node.host, node)
        # %C: a hash of the connection's endpoints, short enough for a socket path
        return ["-o", "ControlMaster=auto", "-o", f"ControlPath={self.dir}/%C", "-o", f"ControlPersist={PERSIST}"]

    def close(self) -> None:
        with self.lock:
            where, nodes = self.dir, list(self.used.values())
            self.dir, self.used = None, {}
        if where is None:
            return
        from .parallel import on_each

        def stop(node: NodeConfig) -> None:
            argv = [*ssh_args(node, control=False), "-o", f"ControlPath={where}/%C", "-O", "exit", "--", node.host]
            try:
                subprocess.run(argv, capture_output=True, timeout=EXIT_TIMEOUT, stdin=subprocess.DEVNULL)
            except (OSError, subprocess.SubprocessError):
                pass  # no master (never connected), or a dead one: it persists at most PERSIST seconds

        on_each(nodes, stop, inbox=None, name="ssh-exit")
        shutil.rmtree(where, ignore_errors=True)


CONTROL = ControlSockets()


class StartGate:
    """At most ``ssh.max_parallel`` ssh connections being set up at once (from start until the
    agent's first bytes or the end), so a jump host in front of many nodes keeps within its
    sshd's MaxStartups (10 unauthenticated connections by default) instead of dropping some."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.slots: threading.BoundedSemaphore | None = None

    def enter(self, limit: int) -> threading.BoundedSemaphore:
        with self.lock:
            if self.slots is None:
                self.slots = threading.BoundedSemaphore(limit)
            slots = self.slots
        slots.acquire()
        return slots


GATE = StartGate()


class OpenSSHProcess(LocalProcess):
    """The ssh client's pipes; its start slot is given back at the first bytes from the agent."""

    def __init__(self, proc: subprocess.Popen, slot: threading.BoundedSemaphore):
        super().__init__(proc)
        self._slot: threading.BoundedSemaphore | None = slot
        self._slot_lock = threading.Lock()

    def read_stdout(self) -> bytes:
        data = super().read_stdout()
        self.release()
        return data

    def release(self) -> None:
        with self._slot_lock:
            slot, self._slot = self._slot, None
        if slot is not None:
            slot.release()

    def close(self) -> None:
        super().close()
        self.release()


def ssh_args(node: NodeConfig, control: bool = False) -> list[str]:
    """ssh and its options for ``node``, up to (not including) ``-- HOST``; with ``control``,
    through the run's shared connection to it."""
    ssh = node.ssh
    args = [shutil.which("ssh") or "ssh"]
    if ssh.config_file:
        args += ["-F", ssh.config_file]
    args += ["-T", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={max(1, round(ssh.connect_timeout))}"]
    if control:
        args += CONTROL.options(node)
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
        argv = [*ssh_args(self.node, control=True), "--", self.node.host, command]
        slot = GATE.enter(self.node.ssh.max_parallel)
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True)  # Ctrl-C reaches ddp-up only
        except OSError as e:
            slot.release()
            raise ConnectFailed(NodeProblem(self.node.label, f"cannot run ssh: {e.strerror}",
                                            "install the OpenSSH client, or set `ssh: {client: fabric}`")) from None
        return OpenSSHProcess(proc, slot)


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
     "during the handshake", "too many connections at once through one host (sshd's MaxStartups): lower "
                            "ssh.max_parallel (default 10), or raise MaxStartups there"),
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
