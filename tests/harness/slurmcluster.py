"""A real Slurm cluster on this machine for the tests: munged and slurmctld in one network
namespace, one slurmd per node namespace, clients (srun, salloc, scancel) in the root namespace.

Facts it relies on (found on these machines, see ../shared/slurmcluster/RECIPE.md):
- daemons enter their namespace with nsenter plus unshare (UTS, mount), not `ip netns exec`,
  which remounts /sys and hides the cgroup filesystem slurmd 22.05 needs;
- each daemon's /etc/hosts is a bind mount of one hosts file, so node names resolve there only;
- Debian's 22.05.8 sends some step messages to an srun on a host that is not a node at 0.0.0.0:
  declaring the client host as a FUTURE node with the bridge's address works around it;
- proctrack/linuxproc misses processes that left their session: down() kills whatever is left
  in each node namespace;
- munged listens on a path socket, usable from every namespace.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

NET = "10.87.0"
BRIDGE = "ddpslbr"
PREFIX = "dsl"  # namespaces and host names: dsl0 (the controller), dsl1..dslN
DAEMONS = ("slurmctld", "slurmd", "munged")


def available() -> str | None:
    """Why this machine cannot run the cluster, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    missing = [d for d in DAEMONS if not shutil.which(d, path="/usr/sbin:/usr/bin:/sbin")]
    if missing or not shutil.which("srun"):
        return "Slurm is not installed (apt-get install slurm-wlm munge)"
    return None


def _run(*args: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(args, check=check, capture_output=True, text=True, timeout=60, **kw)


class SlurmCluster:
    def __init__(self, size: int, base: Path):
        self.size = size
        self.base = base
        self.run_dir, self.etc, self.spool, self.logs = (base / d for d in ("run", "etc", "spool", "log"))
        self.conf = self.etc / "slurm.conf"
        self.hosts = self.run_dir / "hosts"
        self.names = [f"{PREFIX}{k}" for k in range(1, size + 1)]
        self.client = socket.gethostname().split(".")[0]

    @property
    def env(self) -> dict[str, str]:
        """The environment a client (srun, salloc, ddp-up) needs."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    # --- up -------------------------------------------------------------------------------------

    def up(self) -> SlurmCluster:
        self.down()  # what a killed run left
        self.made_etc = not os.path.isdir("/etc/slurm")  # the daemons' bind-mount target (Debian ships it)
        if self.made_etc:
            os.mkdir("/etc/slurm")
        for d in (self.run_dir, self.etc, self.spool / "ctld", self.logs, self.base / "munge"):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(self.base / "munge", 0o700)
        self._network()
        self._munge()
        self._write_conf()
        self._daemon(0, f"/usr/sbin/slurmctld -f {self.conf}", "ctl")
        for k, name in enumerate(self.names, start=1):
            (self.spool / name).mkdir(exist_ok=True)
            self._daemon(k, f"/usr/sbin/slurmd -f {self.conf} -N {name}", name)
        self._wait_idle()
        return self

    def _network(self) -> None:
        _run("ip", "link", "add", BRIDGE, "type", "bridge")
        _run("ip", "addr", "add", f"{NET}.253/24", "dev", BRIDGE)
        _run("ip", "link", "set", BRIDGE, "up")
        lines = ["127.0.0.1 localhost", f"{NET}.254 ctl", f"{NET}.253 {self.client}"]
        lines += [f"{NET}.{k} {name}" for k, name in enumerate(self.names, start=1)]
        self.hosts.write_text("\n".join(lines) + "\n")
        for k in range(self.size + 1):
            ns, addr = f"{PREFIX}{k}", f"{NET}.{254 if k == 0 else k}"
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", f"{BRIDGE}{k}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "link", "set", f"{BRIDGE}{k}", "master", BRIDGE, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")

    def _munge(self) -> None:
        key = self.base / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        socket_path = self.run_dir / "munge.socket"
        self._daemon(0, f"/usr/sbin/munged --force --key-file={key} --socket={socket_path} "
                        f"--pid-file={self.run_dir}/munged.pid --log-file={self.logs}/munged.log "
                        f"--seed-file={self.base}/munge/munged.seed --num-threads=4", "ctl", slurm_etc=False)
        deadline = time.monotonic() + 10
        while not socket_path.exists():
            assert time.monotonic() < deadline, "munged did not start: " + self._log("munged.log")
            time.sleep(0.05)

    def _write_conf(self) -> None:
        r = self.run_dir
        self.conf.write_text(f"""ClusterName=ddpup
SlurmctldHost=ctl({NET}.254)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={r}/munge.socket
StateSaveLocation={self.spool}/ctld
SlurmdSpoolDir={self.spool}/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.%n.pid
SlurmctldLogFile={self.logs}/slurmctld.log
SlurmdLogFile={self.logs}/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MailProg=/bin/true
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=30
KillWait=10
MessageTimeout=10
TCPTimeout=2
NodeName={PREFIX}[1-{self.size}] NodeAddr={NET}.[1-{self.size}] CPUs=4 RealMemory=1000 State=UNKNOWN
NodeName={self.client} NodeAddr={NET}.253 CPUs=1 State=FUTURE
PartitionName=debug Nodes={PREFIX}[1-{self.size}] Default=YES MaxTime=INFINITE State=UP
""")

    def _daemon(self, k: int, command: str, hostname: str, slurm_etc: bool = True) -> None:
        """Start a daemon in namespace k with its own host name and /etc/hosts (and /etc/slurm)."""
        mounts = f"mount --bind {self.hosts} /etc/hosts"
        if slurm_etc:
            mounts += f" && mount --bind {self.etc} /etc/slurm"
        _run("nsenter", f"--net=/run/netns/{PREFIX}{k}", "unshare", "--uts", "--mount", "sh", "-c",
             f"hostname {hostname} && {mounts} && exec {command}")

    def _wait_idle(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while True:
            out = _run("sinfo", "-h", "-N", "-t", "idle", "-o", "%N", check=False, env=self.env).stdout
            if len(set(out.split())) >= self.size:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"Slurm nodes not idle within {timeout} s: {out!r}\n" + self._log("slurmctld.log"))
            time.sleep(0.1)

    def _log(self, name: str) -> str:
        try:
            return (self.logs / name).read_text()[-2000:]
        except OSError:
            return "(no log)"

    # --- down -----------------------------------------------------------------------------------

    def down(self) -> None:
        """Every process in our namespaces (daemons, steps, anything they left), the namespaces,
        the bridge and the directory; idempotent, and only what carries our names."""
        listed = _run("ip", "netns", "list", check=False).stdout.split("\n")
        ours = [line.split()[0] for line in listed if line.split() and line.split()[0].startswith(PREFIX)
                and line.split()[0][len(PREFIX):].isdigit()]
        for ns in sorted(ours, key=lambda n: n == f"{PREFIX}0"):  # slurmds before the controller
            _stop([int(p) for p in _run("ip", "netns", "pids", ns, check=False).stdout.split()])
            _run("ip", "netns", "del", ns, check=False)
        munged = self.run_dir / "munged.pid"
        if munged.exists():
            try:
                _stop([int(munged.read_text().strip())], comm="munged")
            except ValueError:
                pass
        for k in range(self.size + 1):
            _run("ip", "link", "del", f"{BRIDGE}{k}", check=False)
        _run("ip", "link", "del", BRIDGE, check=False)
        shutil.rmtree(self.base, ignore_errors=True)
        if getattr(self, "made_etc", False):
            os.rmdir("/etc/slurm")
            self.made_etc = False


def _stop(pids: list[int], comm: str | None = None, grace: float = 5.0) -> None:
    """SIGTERM, then SIGKILL what is left after ``grace``; a zombie counts as gone."""
    def alive(pid: int) -> bool:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            if comm is not None and f"({comm})" not in stat:
                return False
            return stat.rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    pids = [p for p in pids if alive(p)]
    for sig in (15, 9):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = [p for p in pids if alive(p)]
        if not pids:
            return
