"""The user's own OpenSSH client as a transport: ``ssh -T -o BatchMode=yes -- HOST COMMAND``.

If ``ssh HOST`` works, this works: every setting the user's ssh honours applies (config files,
Include and Match, ProxyJump and ProxyCommand, known-hosts files, StrictHostKeyChecking, host
certificates, the agent), because ssh itself applies it. ddp-up adds only what the cluster file
says (user, port, identity file, known_hosts, connect timeout, config file) and BatchMode, so
nothing ever prompts; the identity file and known_hosts through a config file of the run, so that
jump hosts get them too. The agent's protocol runs over the pipes of the ssh process exactly as the
local transport runs over a subprocess's; what ddp-up needs to know itself (the address other
nodes use, the host-key policy) comes from ``ssh -G``. A failure is ssh's exit status 255 and its
words on stderr, turned into one problem and its fix (``ssh_failure``).

With no setting anywhere, an unknown host key is refused: OpenSSH's default is to ask, and
BatchMode turns asking into refusing.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
from functools import lru_cache
from typing import Mapping, NamedTuple, Sequence

from ..config.cluster import NodeConfig
from ..errors import NodeProblem
from . import sshproblems as problems
from .sshmaster import CONTROL
from .transport import ConnectFailed, LocalProcess, RemoteProcess, Transport, remote_command

G_TIMEOUT = 10.0  # `ssh -G` only reads config files


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


# The remote shell prints this before anything else: the first byte back means the connection is
# authenticated and the session runs, so its start slot is free (MaxStartups counts only
# unauthenticated connections) while the agent is still starting up.
LOGGED_IN = b"@"


class OpenSSHProcess(LocalProcess):
    """The ssh client's pipes; its start slot is given back at the first byte from the node."""

    def __init__(self, proc: subprocess.Popen, slot: threading.BoundedSemaphore):
        super().__init__(proc)
        self._slot: threading.BoundedSemaphore | None = slot
        self._slot_lock = threading.Lock()
        self.logged_in = False  # the remote shell's first byte came: the node was reached

    def read_stdout(self) -> bytes:
        data = super().read_stdout()
        if self._slot is not None:  # the first read (only the reader thread reads)
            self.logged_in = bool(data)
            self.release()
            if data.startswith(LOGGED_IN):
                data = data[len(LOGGED_IN):] or super().read_stdout()
        return data

    def release(self) -> None:
        with self._slot_lock:
            slot, self._slot = self._slot, None
        if slot is not None:
            slot.release()

    def close(self) -> None:
        if self._slot is not None:  # not logged in yet: nothing of ours runs on the node, and
            self.terminate()  # the writer may be blocked on the stdin of a client still connecting
        super().close()
        self.release()


DROP_TIMEOUT = 5.0  # for `ssh -O exit` to a lost node's master (it answers over a local socket)


def drop_shared(node: NodeConfig) -> None:
    """A node declared lost: its shared connection is never used again. Later ssh processes for it
    open a new one (SSHRun.renew), and the old master is asked to exit (`ssh -O exit`, on a thread
    of its own, bounded), which ends the sessions still riding it: a writer blocked on a dead link
    fails instead of holding a close."""
    old = ssh_args(node, control=True, master=False)
    CONTROL.renew(node)

    def ask() -> None:
        try:
            subprocess.run([*old, "-O", "exit", "--", node.host], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=DROP_TIMEOUT)
        except (OSError, subprocess.SubprocessError):
            pass  # no master, or one that does not answer: close() ends it at the run's end
    threading.Thread(target=ask, name=f"{node.label}-drop", daemon=True).start()


def ssh_args(node: NodeConfig, control: bool = False, master: bool = True) -> list[str]:
    """ssh and its options for ``node``, up to (not including) ``-- HOST``; with ``control``,
    through the run's shared connection to it (``master``: see SSHRun.options)."""
    ssh = node.ssh
    args = [shutil.which("ssh") or "ssh"]
    config = CONTROL.config_for(ssh)
    if config or ssh.config_file:
        args += ["-F", config or ssh.config_file]
    args += ["-T", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={max(1, round(ssh.connect_timeout))}"]
    if control:
        args += CONTROL.options(node, master)
    if ssh.user:
        args += ["-l", ssh.user]
    if ssh.port:
        args += ["-p", str(ssh.port)]
    if not config:
        if ssh.identity_file:
            args += ["-i", ssh.identity_file]
        if ssh.known_hosts_set:
            args += ["-o", f"UserKnownHostsFile={ssh.known_hosts}"]
    return args


class OpenSSHTransport(Transport):
    """Nothing to open ahead: ssh connects when the agent starts, and a failure to connect is its
    exit status 255 with its reason on stderr (see ``ssh_failure``). ``shared``: through the run's
    connection to the node; else a connection of its own (a lost node's sweep: the shared one may
    be dead without knowing it, and a session asked of it would wait far past ConnectTimeout).
    ``master``: whether it may become that connection (SSHRun.options)."""

    def __init__(self, node: NodeConfig, shared: bool = True, bulk: bool = False, master: bool = True):
        super().__init__(node)
        self.shared, self.bulk, self.master = shared, bulk, master

    def connect(self) -> None:
        pass

    def start(self, python: str, bootstrap_args: list[str], tags: Mapping[str, str],
              setup: tuple[str, ...] = (), workdir: str | None = None) -> RemoteProcess:
        command = f"printf {LOGGED_IN.decode()}; " + remote_command(python, bootstrap_args, tags, setup, workdir)
        own = [] if self.shared else ["-o", "ControlMaster=no", "-o", "ControlPath=none"]
        if self.bulk:
            own += bulk_ciphers(self.node)
        argv = [*ssh_args(self.node, control=self.shared, master=self.master), *own, "--", self.node.host, command]
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


def bulk_ciphers(node: NodeConfig) -> list[str]:
    """ssh options for a connection that carries bulk bytes (ddp-fetch): OpenSSH's own ciphers
    with AES-GCM first, where the user's config leaves the choice to OpenSSH and this CPU has AES
    instructions (OpenSSH puts chacha20 first, the faster one without them; with them AES-GCM
    takes a quarter less time end to end: rsync of 1 GiB, 2.67 -> 2.05 s). The same ciphers in
    another order, nothing added or taken away; a config that names its ciphers is followed."""
    default = _default_ciphers()
    if not default or not _has_aes() or resolved(node).get("ciphers") != default:
        return []
    names = default.split(",")
    first = [c for c in names if c.startswith("aes") and "-gcm@" in c]
    return ["-o", "Ciphers=" + ",".join(first + [c for c in names if c not in first])] if first else []


@lru_cache(maxsize=1)
def _default_ciphers() -> str:
    """The ciphers this ssh offers when no config file chooses ("" if it cannot say)."""
    try:
        out = subprocess.run([shutil.which("ssh") or "ssh", "-F", "none", "-G", "localhost"], capture_output=True,
                             text=True, timeout=G_TIMEOUT, stdin=subprocess.DEVNULL).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return next((line.split(" ", 1)[1] for line in out.splitlines() if line.startswith("ciphers ")), "")


@lru_cache(maxsize=1)
def _has_aes() -> bool:
    """Whether this CPU has AES instructions (Linux: x86's `aes` flag, Arm's `aes` feature)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return any(line.split(":", 1)[0].strip() in ("flags", "Features") and "aes" in line.split()
                       for line in f)
    except OSError:
        return False


class Inspection(NamedTuple):
    """What a failed connection looked like, asked of ssh after the fact (``inspect``)."""

    where: str  # user@host:port, as ssh resolved them
    hostname: str  # the address ssh connects to
    known_hosts: str  # where a new key belongs: the cluster file's, else the first UserKnownHostsFile
    key: str | None = None  # the host key that was refused: "ssh-ed25519 SHA256:..."
    key_of: str | None = None  # "host:port" that presented it (a jump host's, or the node's)
    said: str = ""  # what that connection's ssh processes said, debug lines left out


def inspect(node: NodeConfig, want_key: bool) -> Inspection:
    """``ssh -G`` for the names; with ``want_key``, one more connection with ``-v`` and without
    the shared master, to read the refused key's fingerprint (ssh prints it only at debug level)
    and what a jump host said (a ControlPersist master sends a ProxyJump hop's stderr to
    /dev/null). Runs only after a failure."""
    facts = resolved(node)
    user, port = facts.get("user", node.ssh.user or "?"), facts.get("port", str(node.ssh.port or 22))
    hostname = facts.get("hostname", node.host)
    known = node.ssh.known_hosts if node.ssh.known_hosts_set else \
        (facts.get("userknownhostsfile") or "~/.ssh/known_hosts").split()[0]
    found = Inspection(f"{user}@{node.host}:{port}", hostname, known)
    if not want_key:
        return found
    argv = [*ssh_args(node), "-v", "--", node.host, "true"]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, errors="replace", stdin=subprocess.DEVNULL,
                             timeout=2 * node.ssh.connect_timeout + G_TIMEOUT)
    except (OSError, subprocess.SubprocessError):
        return found
    key = key_of = None
    said = []
    for line in out.stderr.splitlines():
        if (m := _AUTHENTICATING.search(line)) is not None:
            key_of = m.group(1)
        elif (m := _SERVER_KEY.search(line)) is not None:
            key = m.group(1)
        elif not line.startswith(("debug", "OpenSSH_")):
            said.append(line)
    return found._replace(key=key, key_of=key_of if key else None, said="\n".join(said))


_AUTHENTICATING = re.compile(r"debug1: Authenticating to (\S+) as ")
# ssh's words when the ControlPath socket cannot be made (a path too long, a directory not writable)
_CONTROL_SOCKET = re.compile(r"(unix_listener: [^\n]*|ControlPath [^\n]*too long[^\n]*|"
                             r"ControlSocket [^\n]*|muxserver_listen[^\n]*)")
_SERVER_KEY = re.compile(r"debug1: Server host (?:key|certificate): (\S+ [^\s,]+)")


def ssh_failure(node: NodeConfig, stderr_tail: Sequence[str], ask=inspect) -> NodeProblem:
    """Why ssh exited 255 before the agent answered: its last stderr lines, and (for a host key
    or a time-out) ``ask`` for the details the one-line problem and its fix name."""
    return _described(node, "\n".join(stderr_tail), ask)


def _described(node: NodeConfig, text: str, ask, again: bool = True) -> NodeProblem:
    host, label = node.host, node.label
    key_problem = _key_problem(node, text, ask)
    if key_problem is not None:
        return key_problem
    socket_problem = _CONTROL_SOCKET.search(text)
    if socket_problem is not None:  # before authentication: a socket's bind can say "Permission denied" too
        return NodeProblem(label, f"ssh could not make its shared connection's socket ({socket_problem.group(0)})",
                           "give ddp-up a short, private, writable TMPDIR (or unset it), or set ControlPath in "
                           "your SSH config to a directory you own")
    if "Permission denied (" in text:  # ssh's refusal names the methods it tried: "(publickey,password)"
        return problems.auth_failed(label, ask(node, False).where)
    if "banner exchange" in text or "Bad remote protocol version" in text:
        return NodeProblem(label, f"{host} did not answer as an SSH server ({_last_line(text)})",
                           "check `port:` and that sshd (not another service) listens there")
    if "Could not resolve hostname" in text:
        return problems.unresolvable(label, host)
    if "Connection refused" in text:
        return problems.refused(label, ask(node, False).where)
    for unreachable in ("No route to host", "Network is unreachable"):
        if unreachable in text:
            return problems.unreachable(label, ask(node, False).where, unreachable)
    if "timed out" in text:
        return problems.no_answer(label, ask(node, False).where, node.ssh.connect_timeout)
    if again and ("kex_exchange_identification" in text or "Connection closed by" in text):
        # a jump host's refusal is silent under ControlPersist: ask again, with its words
        seen = ask(node, True)
        if any(reason in seen.said for reason in _REASONS):
            return _described(node, seen.said, lambda _node, _key: seen, again=False)
    if "kex_exchange_identification" in text:
        return NodeProblem(label, "the SSH server (or a jump host in front of it) dropped the connection during "
                           "the handshake", "too many connections at once through one host (sshd's MaxStartups): "
                           "lower ssh.max_parallel (default 10), or raise MaxStartups there")
    if "Connection closed by" in text:
        return NodeProblem(label, "the SSH server (or a jump host in front of it) closed the connection",
                           f"run `{problems.command('ssh', host, 'true')}` by hand to see why")
    return NodeProblem(label, f"ssh to {host} failed: {_last_line(text)}",
                       f"run `{problems.command('ssh', host, 'true')}` to see why")


def _key_problem(node: NodeConfig, text: str, ask) -> NodeProblem | None:
    """A host key (or certificate) that ssh refused, named with its fix; None for anything else."""
    host, label = node.host, node.label
    if "REMOTE HOST IDENTIFICATION HAS CHANGED" in text:
        seen = ask(node, False)
        return problems.changed_key(label, host, seen.hostname, seen.known_hosts)
    certificate = re.search(r"Certificate invalid: (.+)", text)
    if certificate is not None and "Host key verification failed" in text:
        seen = ask(node, True)
        jump = _jump_host(seen)
        of = f" of jump host {jump}" if jump else ""
        return NodeProblem(label, f"the host certificate{of} is not valid for it ({certificate.group(1).strip()}): "
                           "refusing to connect",
                           f"have the site's SSH CA sign that host key for the name ssh uses ({seen.hostname}), or "
                           "fix `host:`; `ssh-keygen -L -f CERT` on the node shows what the certificate names")
    if "Host key verification failed" in text:
        seen = ask(node, True)
        key_host, _, key_port = (seen.key_of or "").rpartition(":")
        keyscan = (("-p", key_port) if key_port not in ("", "22") else ()) + (key_host or seen.hostname,)
        return problems.unknown_key(label, seen.key, _jump_host(seen), keyscan, seen.known_hosts)
    return None


def _last_line(text: str) -> str:
    return next((line.strip() for line in reversed(text.splitlines()) if line.strip()), "no message")


_REASONS = ("REMOTE HOST IDENTIFICATION HAS CHANGED", "Host key verification failed", "Permission denied",
            "Could not resolve hostname", "Connection refused", "No route to host", "Network is unreachable",
            "timed out")


def _jump_host(seen: Inspection) -> str | None:
    """The jump host whose key was refused, or None where it was the node's own."""
    key_host = (seen.key_of or "").rpartition(":")[0]
    return key_host if seen.key_of is not None and key_host != seen.hostname else None
