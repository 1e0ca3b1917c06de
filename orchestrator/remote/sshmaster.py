"""One ddp-up command's shared OpenSSH connections: a ControlMaster per node in a private
directory, the cluster file's ssh settings as a config file every hop reads, and the end of it
all (each master asked to exit over its socket, in OpenSSH's mux protocol, as `ssh -O exit` does).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import stat
import struct
import tempfile
import threading

from ..config.cluster import NodeConfig, SSHSettings
from .parallel import on_each

PERSIST = 60  # seconds an idle master stays up: if ddp-up dies without closing it, it ends by itself
EXIT_TIMEOUT = 5.0  # for a master's answer to the request to exit
RUN_DIR = re.compile(r"ddp-up-ssh-(\d+)-\w+")  # ours: the pid that made it, then mkdtemp's random part
# ssh binds a master's socket at ControlPath plus a random suffix of its own (17 characters), then
# renames it: the run's directory must leave room for "/", %C (40 hex digits) and that suffix within
# a Unix socket's path, 104 bytes on the BSDs and macOS, 108 on Linux (the smaller holds everywhere).
SOCKET_PATH_MAX = 104
SOCKET_ROOM = 1 + 40 + 17 + 4  # and a renewed connection's prefix ("g12-": see SSHRun.renew)


def run_parent() -> str:
    """Where the run's directory goes: the temp directory, unless its path leaves too little room
    for the sockets (a TMPDIR a little longer than usual made every node fail); then the user's
    runtime directory, then /tmp. mkdtemp makes it private (0700, a random name) wherever it is."""
    name = len(f"/ddp-up-ssh-{os.getpid()}-") + 8  # mkdtemp's random part
    for parent in (tempfile.gettempdir(), os.environ.get("XDG_RUNTIME_DIR"), "/tmp"):
        if parent and os.path.isdir(parent) and len(parent) + name + SOCKET_ROOM <= SOCKET_PATH_MAX:
            return parent
    return "/tmp"


class SSHRun:
    """What one ddp-up command shares among its ssh processes, in a private directory (mkdtemp:
    0700, a fresh random name): one ControlMaster per node, so every ssh ddp-up starts for a node
    (the `gpus: auto` probe, sync, the job's agent, sweeps) rides one connection; and the cluster
    file's own ssh settings as a config file that every hop reads (see ``config_for``).
    ``close`` ends the masters and removes the directory; a directory left by a ddp-up that was
    killed is removed by the next one, once its masters have timed out."""

    def __init__(self) -> None:
        self.dir: str | None = None
        self.configs: dict[tuple, str] = {}
        self.renewed: dict[tuple, int] = {}  # a node's connections renewed so far (see renew)
        self.lock = threading.Lock()

    def _where(self) -> str:
        with self.lock:
            if self.dir is None:
                parent = run_parent()
                remove_stale_run_dirs(parent)
                self.dir = tempfile.mkdtemp(prefix=f"ddp-up-ssh-{os.getpid()}-", dir=parent)
            return self.dir

    def options(self, node: NodeConfig, master: bool = True) -> list[str]:
        """``master``: this ssh becomes the node's master where there is none yet. Two that start
        together would race to be it, and the loser says so on stderr ("ControlSocket ... already
        exists"): a connection that starts beside the run's first one (a kept interpreter's, as the
        agent's starts) uses the master where there is one, else a connection of its own."""
        where = self._where()
        with self.lock:
            times = self.renewed.get(_endpoint(node), 0)
        # %C: a hash of the connection's endpoints, short enough for a socket path
        return ["-o", f"ControlMaster={'auto' if master else 'no'}",
                "-o", f"ControlPath={where}/{f'g{times}-' if times else ''}%C", "-o", f"ControlPersist={PERSIST}"]

    def renew(self, node: NodeConfig) -> None:
        """From now on, ``node``'s ssh processes share a new connection (a new socket): the one
        before may be dead without knowing it (a node lost: TCP backs off for minutes before it
        gives up, and a session asked of it waits as long). The old master is asked to exit by
        the caller, and in any case by ``close``, with every other socket of the run."""
        with self.lock:
            key = _endpoint(node)
            self.renewed[key] = self.renewed.get(key, 0) + 1

    def config_for(self, ssh: SSHSettings) -> str | None:
        """A config file that puts the cluster file's identity file and known_hosts before the
        user's own config, or None when the cluster file sets neither. On the command line they
        would reach the node's connection only; ssh hands ``-F`` to a ProxyJump hop, so this way
        a jump host is checked against the same known_hosts (and offered the same key) as the node."""
        files = [("UserKnownHostsFile", ssh.known_hosts if ssh.known_hosts_set else None),
                 ("IdentityFile", ssh.identity_file)]
        words = [(key, _config_word(value)) for key, value in files if value]
        if not words or any(word is None for _, word in words):
            return None  # nothing to add, or a path ssh_config cannot quote: the command line only
        lines = ["BatchMode yes", *(f"{key} {word}" for key, word in words)]
        if ssh.config_file:
            lines.append(f"Include {_config_word(ssh.config_file)}")
        else:  # what ssh reads when no -F is given
            lines += ["Include ~/.ssh/config", "Include /etc/ssh/ssh_config"]
        key = tuple(lines)
        where = self._where()
        with self.lock:
            if key not in self.configs:
                path = os.path.join(where, f"config{len(self.configs)}")
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write("# ddp-up: the cluster file's ssh settings, then the user's own config\n")
                    f.write("\n".join(lines) + "\n")
                self.configs[key] = path
            return self.configs[key]

    def close(self) -> None:
        """End every master of this run, then remove its directory. Every socket in the directory
        is one of ours (it is private), so no node needs naming: each master is asked to exit
        over its socket, as `ssh -O exit` asks it, without a process per node."""
        with self.lock:
            where, self.dir, self.configs, self.renewed = self.dir, None, {}, {}
        if where is None:
            return
        on_each(control_sockets(where), lambda path: end_master(path, EXIT_TIMEOUT), inbox=None, name="ssh-exit")
        shutil.rmtree(where, ignore_errors=True)


def _endpoint(node: NodeConfig) -> tuple:
    return node.host, node.ssh.user, node.ssh.port, node.ssh.config_file


# ssh's connection-sharing protocol (OpenSSH's PROTOCOL.mux): what `ssh -O exit` sends
MUX_HELLO, MUX_VERSION, MUX_TERMINATE, MUX_OK = 0x00000001, 4, 0x10000005, 0x80000001
MUX_MAX_PACKET = 1 << 16


def _mux_packet(*words: int) -> bytes:
    body = struct.pack(f">{len(words)}I", *words)
    return struct.pack(">I", len(body)) + body


def _mux_read(sock: socket.socket) -> bytes:
    def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            more = sock.recv(n - len(data))
            if not more:
                raise EOFError("the master closed the connection")
            data += more
        return data
    size = struct.unpack(">I", exactly(4))[0]
    if size > MUX_MAX_PACKET:
        raise ValueError(f"mux packet of {size} bytes")
    return exactly(size)


def end_master(path: str, timeout: float) -> bool:
    """Ask the ControlMaster listening at ``path`` to exit; True once it said it will. A master
    that does not answer (gone, or hung) ends by itself PERSIST seconds after its last session."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(path)
            sock.sendall(_mux_packet(MUX_HELLO, MUX_VERSION) + _mux_packet(MUX_TERMINATE, 1))
            hello = _mux_read(sock)
            if hello[:4] != struct.pack(">I", MUX_HELLO):
                return False
            return _mux_read(sock)[:8] == struct.pack(">II", MUX_OK, 1)
    except (OSError, EOFError, ValueError, struct.error):
        return False


def control_sockets(directory: str) -> list[str]:
    """The sockets in a run directory: its masters' control sockets."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = []
    for name in names:
        path = os.path.join(directory, name)
        try:
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                found.append(path)
        except OSError:
            continue
    return found


def _config_word(value: str) -> str | None:
    """``value`` as one ssh_config argument (double-quoted), or None if it cannot be one."""
    if any(c in value for c in '"\\\n\r'):
        return None
    return f'"{value}"'


def remove_stale_run_dirs(parent: str) -> None:
    """Remove the run directories of ddp-up commands that are gone (killed: no `close`), once no
    master listens in them. Only this user's own directories, never through a link."""
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return
    for entry in entries:
        found = RUN_DIR.fullmatch(entry.name)
        try:
            if not found or not entry.is_dir(follow_symlinks=False) or \
                    entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
        except OSError:
            continue
        if _pid_alive(int(found.group(1))) or master_listens(entry.path):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # someone else's process: alive
    return True


def master_listens(directory: str) -> bool:
    for path in control_sockets(directory):
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.settimeout(1.0)
                probe.connect(path)
            return True
        except OSError:
            continue
    return False


CONTROL = SSHRun()
