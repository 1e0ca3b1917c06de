"""A real multi-host SSH cluster on one Linux machine, for integration tests (needs root).

Node K is a network namespace with a veth ``eth0`` at ``NET.K/24`` on a private bridge, its own
hostname (UTS namespace), an /etc/hosts naming every node, and its own OpenSSH ``sshd`` (key
only, throwaway host key). Traffic stays on the test subnet: no default route, no forwarding.
All nodes share the filesystem, /root and one PID space (so tags must name the node).
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from orchestrator.node.local.procs import wait_gone

SSHD = "/usr/sbin/sshd"


def available() -> str | None:
    """None if this machine can host the cluster, else the reason it cannot."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in (SSHD, shutil.which("ip"), shutil.which("unshare"), shutil.which("ssh-keygen")):
        if not tool or not os.path.exists(tool):
            return "needs openssh-server, openssh-client and iproute2 (apt-get install openssh-server iproute2)"
    return None


@dataclass(frozen=True)
class Node:
    index: int  # 1-based, as in the addresses
    name: str  # hostname inside the node, and its namespace name
    addr: str


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(args, check=check, capture_output=True, text=True, timeout=30)


TAGS = range(20, 220)  # the third octet of a cluster's subnet, 10.213.TAG.0/24, and its names' suffix


def claim_tag() -> tuple[int, socket.socket]:
    """A subnet no other live cluster holds, in this test run (its workers, a module's own bigger
    cluster) or another on this machine, and what holds it until down() or this process's end: a
    Unix socket bound to an abstract name (no file to leave behind; the kernel frees the name when
    the socket closes). A tag from a pid alone was not enough: two clusters once drew the same one,
    and the second's up() removed the first's namespaces mid-test. A crashed run's leftovers hold
    no name: their tag is claimed again, and up() clears them."""
    start = os.getpid() % len(TAGS)  # spread the runs' first tries
    for step in range(len(TAGS)):
        tag = TAGS[(start + step) % len(TAGS)]
        holder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            holder.bind(f"\0ddp-up-tests-net{tag}")
            return tag, holder
        except OSError:  # EADDRINUSE: a live cluster holds it
            holder.close()
    raise RuntimeError(f"no free test subnet: every tag in {TAGS} is held by a live cluster")


class SSHCluster:
    def __init__(self, size: int, base: Path):
        self.tag, self._tag_holder = claim_tag()  # a subnet of its own, held while this process lives
        tag = self.tag
        self.size = size
        self.base = base
        self.net = f"10.213.{tag}"
        self.prefix = f"ddpt{tag}n"
        self.bridge = f"ddptbr{tag}"
        self.nodes = [Node(k, f"{self.prefix}{k}", f"{self.net}.{k}") for k in range(1, size + 1)]
        self.keys = base / "keys"
        self.run_dir = base / "run"
        self.client_key = self.keys / "id_ed25519"
        self.host_key = self.keys / "ssh_host_ed25519_key"
        self.known_hosts = base / "known_hosts"

    # --- lifecycle ---

    def up(self) -> SSHCluster:
        self._remove_network()  # leftovers of a crashed run with the same tag
        self.keys.mkdir(parents=True, exist_ok=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
        for key in (self.host_key, self.client_key):
            if not key.exists():
                _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key))
        shutil.copy(f"{self.client_key}.pub", self.keys / "authorized_keys")
        for node in self.nodes:
            self.hosts_file(node).write_text(self.hosts_text())
        self.shell_rc.write_text(f"export PATH={shlex.quote(os.path.dirname(sys.executable))}:\"$PATH\"\n")
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.net}.254/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for node in self.nodes:
            self._start_node(node)
        self._pin_neighbors()
        host_key = " ".join(Path(f"{self.host_key}.pub").read_text().split()[:2])
        self.known_hosts.write_text("".join(f"{n.addr} {host_key}\n" for n in self.nodes))
        for node in self.nodes:
            self._wait_listening(node)
        return self

    def _start_node(self, node: Node) -> None:
        ns, veth = node.name, f"{self.bridge}v{node.index}"
        _run("ip", "netns", "add", ns)
        _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns,
             "address", self.mac(node))
        _run("ip", "link", "set", veth, "master", self.bridge, "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "-n", ns, "addr", "add", f"{node.addr}/24", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        config = self.run_dir / f"{ns}.sshd_config"
        config.write_text("\n".join([
            f"ListenAddress {node.addr}",
            f"HostKey {self.host_key}",
            f"PidFile {self.run_dir / (ns + '.pid')}",
            f"AuthorizedKeysFile {self.keys / 'authorized_keys'}",
            "PermitRootLogin prohibit-password", "PasswordAuthentication no",
            "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no", "PrintMotd no",
            "MaxSessions 64", "MaxStartups 200:30:400", "",
        ]))
        _run(SSHD, "-t", "-f", str(config))
        _run("ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c",
             f"hostname {ns} && mount --bind {self.hosts_file(node)} /etc/hosts && {self.own_shell_rc()}"
             f"exec {SSHD} -f {config} -E {self.run_dir / (ns + '.log')}")

    @property
    def shell_rc(self) -> Path:
        return self.run_dir / "bashrc"

    def own_shell_rc(self) -> str:
        """The shell command (ending in ``&& ``, or empty) that gives the node's sessions the
        cluster's own ~/.bashrc, in the node's mount namespace: bash reads ~/.bashrc for every
        command sshd runs, and a developer's may be slow (this machine's runs pyenv init: 60
        processes, 0.12 s of CPU a session) or noisy. It puts this interpreter first on PATH, as
        the developer's would, and nothing else: the nodes no longer depend on who runs the tests."""
        home_rc = Path.home() / ".bashrc"
        if not home_rc.is_file():
            return ""  # bash reads none: nothing to stand in for
        return f"mount --bind {shlex.quote(str(self.shell_rc))} {shlex.quote(str(home_rc))} && "

    def hosts_file(self, node: Node) -> Path:
        """The node's own /etc/hosts (a bind mount of this file: rewritten in place, it changes)."""
        return self.run_dir / f"hosts.{node.name}"

    def hosts_text(self, own: Node | None = None, own_addr: str | None = None) -> str:
        lines = ["127.0.0.1 localhost"] + [f"{own_addr if n is own else n.addr} {n.name}" for n in self.nodes]
        return "\n".join(lines) + "\n"

    @contextmanager
    def hostnames_off_route(self, nodes: list[Node]):
        """Each of ``nodes`` gets a second interface, ``mgmt0``, holding the address its own
        hostname now resolves to (a management NIC, docker0): the other nodes cannot reach it.
        Undone on exit, whatever happened inside."""
        try:
            for node in nodes:
                _run("ip", "-n", node.name, "link", "add", "mgmt0", "type", "veth", "peer", "name", "mgmt1")
                _run("ip", "-n", node.name, "addr", "add", f"{self.mgmt_addr(node)}/24", "dev", "mgmt0")
                for link in ("mgmt0", "mgmt1"):
                    _run("ip", "-n", node.name, "link", "set", link, "up")
                with open(self.hosts_file(node), "w") as f:  # in place: the bind mount keeps the inode
                    f.write(self.hosts_text(node, self.mgmt_addr(node)))
            yield
        finally:
            for node in nodes:
                with open(self.hosts_file(node), "w") as f:
                    f.write(self.hosts_text())
                _run("ip", "-n", node.name, "link", "del", "mgmt0", check=False)

    @contextmanager
    def slow_link(self, node: Node, rate: str = "20mbit"):
        """``node``'s outgoing traffic shaped to ``rate`` (tc tbf: netem is not on these machines);
        the shaping is removed on exit."""
        _run("ip", "netns", "exec", node.name, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", rate,
             "burst", "32kbit", "latency", "400ms")
        try:
            yield
        finally:
            _run("ip", "netns", "exec", node.name, "tc", "qdisc", "del", "dev", "eth0", "root", check=False)

    def mgmt_addr(self, node: Node) -> str:
        return f"10.214.{self.tag}.{node.index}"

    def mac(self, node: Node) -> str:
        """A fixed, locally administered MAC per node, so neighbors can be written down up front."""
        return f"02:dd:{self.tag:02x}:00:{node.index >> 8:02x}:{node.index & 0xff:02x}"

    def _pin_neighbors(self) -> None:
        """Permanent ARP entries for every peer. Otherwise 64 ranks opening a full mesh at once on
        2 busy cores time out resolving each other ("No route to host" from gloo)."""
        for node in self.nodes:
            batch = "".join(f"neigh replace {peer.addr} lladdr {self.mac(peer)} dev eth0 nud permanent\n"
                            for peer in self.nodes if peer is not node)
            if batch:
                subprocess.run(["ip", "-n", node.name, "-batch", "-"], input=batch, check=True,
                               capture_output=True, text=True, timeout=30)

    def start_loopback_sshd(self, node: Node, port: int) -> None:
        """A second sshd inside ``node`` that listens on its 127.0.0.1 only: from outside, the only
        way in is through the node's own sshd (a jump host). Stopped by down() with the node."""
        self.start_sshd(node, f"127.0.0.1:{port}")

    def start_sshd(self, node: Node, listen: str, host_key: Path | None = None,
                   certificate: Path | None = None, host_mounts: bool = False) -> None:
        """Another sshd inside ``node`` on ``listen`` (ADDR:PORT), with its own host key and host
        certificate if given. Stopped by down() with the node. ``host_mounts``: entered with
        `nsenter --net` only, so the host's mounts stay (/sys, cgroups), as a container runtime
        needs: `ip netns exec` remounts /sys, and runc then finds no cgroup mount."""
        port = listen.rpartition(":")[2]
        name = f"{node.name}-{listen.replace(':', '-')}"
        config = self.run_dir / f"{name}.sshd_config"
        main = (self.run_dir / f"{node.name}.sshd_config").read_text()
        text = main.replace(f"ListenAddress {node.addr}", f"ListenAddress {listen}").replace(
            f"{node.name}.pid", f"{name}.pid")
        if host_key is not None:
            text = text.replace(f"HostKey {self.host_key}", f"HostKey {host_key}")
        if certificate is not None:
            text += f"HostCertificate {certificate}\n"
        config.write_text(text)
        _run(SSHD, "-t", "-f", str(config))
        log = self.run_dir / f"{name}.log"
        if host_mounts:
            _run("nsenter", f"--net=/run/netns/{node.name}", "unshare", "--uts", "sh", "-c",
                 f"hostname {node.name} && exec {SSHD} -f {config} -E {log}")
        else:
            _run("ip", "netns", "exec", node.name, "sh", "-c", f"{self.own_shell_rc()}exec {SSHD} -f {config} -E {log}")
        deadline = time.monotonic() + 10
        while "LISTEN" not in _run("ip", "netns", "exec", node.name, "ss", "-ltnH", f"sport = :{port}").stdout:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: sshd not listening on {listen}")
            time.sleep(0.05)

    def host_key_line(self, host: str) -> str:
        """A known_hosts line for ``host`` (``[127.0.0.1]:2222`` form for other ports)."""
        return f"{host} " + " ".join(Path(f"{self.host_key}.pub").read_text().split()[:2]) + "\n"

    def _wait_listening(self, node: Node, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with socket.create_connection((node.addr, 22), timeout=1):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    log = (self.run_dir / f"{node.name}.log")
                    raise RuntimeError(f"{node.name}: sshd not listening: {log.read_text() if log.exists() else ''}")
                time.sleep(0.05)

    def down(self) -> None:
        """Stop every process in every node namespace, delete namespaces, links and files."""
        for node in self.nodes:
            pids = self.namespace_pids(node)
            _signal_all(pids, signal.SIGTERM)
            if wait_gone(pids, 3.0):
                _signal_all(pids, signal.SIGKILL)
                wait_gone(pids, 3.0)
        self._remove_network()
        shutil.rmtree(self.base, ignore_errors=True)
        self._tag_holder.close()  # the subnet is free for the next cluster

    def _remove_network(self) -> None:
        for node in self.nodes:
            _run("ip", "netns", "del", node.name, check=False)
            _run("ip", "link", "del", f"{self.bridge}v{node.index}", check=False)
        _run("ip", "link", "del", self.bridge, check=False)

    # --- faults ---

    def namespace_pids(self, node: Node) -> list[int]:
        out = _run("ip", "netns", "pids", node.name, check=False).stdout
        return [int(p) for p in out.split()]

    def partition(self, node: Node) -> None:
        """Cut the node off without a reset: packets just stop (like a pulled cable)."""
        _run("ip", "-n", node.name, "link", "set", "eth0", "down")

    def heal(self, node: Node) -> None:
        _run("ip", "-n", node.name, "link", "set", "eth0", "up")

    # --- client side ---

    def cluster_file(self, path: Path, nodes: list[tuple[Node, int]], **top) -> Path:
        """Write a cluster YAML for (node, gpus) pairs; ``top`` adds or overrides top-level keys."""
        import yaml

        doc = {
            "nodes": [{"host": n.addr, "gpus": gpus} for n, gpus in nodes],
            "ssh": {"user": "root", "identity_file": str(self.client_key),
                    "known_hosts": str(self.known_hosts), "connect_timeout": 5},
            "report": False,  # its page costs a run 0.2 s of CPU: the tests of it ask for it
            "metrics": False,  # reading every line for metrics costs ~10 µs a line: the tests of it ask for it
        }
        for key, value in top.items():
            if isinstance(value, dict) and isinstance(doc.get(key), dict):
                doc[key] = {**doc[key], **value}
            else:
                doc[key] = value
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
