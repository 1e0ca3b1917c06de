"""The cluster, as validated from the cluster file (clusterfile.py, validate.py): frozen values.

Nothing here reads a file: planning and every later step take these values as they are.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import shlex
import shutil
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal, Mapping

from ..node.local.procs import JOB_SIGNALS  # a stop_signal, or ddp-kill --signal's (the node's launcher: none takes them too)

if TYPE_CHECKING:
    from .containers import ContainerConfig

Transport = Literal["ssh", "local"]

# Names whose values are masked even if `secrets:` does not list them: any that holds one of these
# words (PRIVATE_KEY_PEM, APIKEY and DB_PASS as well as HF_TOKEN), whatever stands around it.
DEFAULT_SECRETS = ("*KEY*", "*PASS*", "*TOKEN*", "*SECRET*", "*CREDENTIAL*", "*AUTH*")




NOT_SECRET = {"true", "false", "yes", "no", "on", "off", "none", "null", "auto", "disabled", "enabled"}


def maskable(value: str) -> bool:
    """Whether a value named like a secret is one to mask everywhere: not a short one, a number
    or a switch (TOKENIZERS_PARALLELISM matches *TOKEN*: masking its "false" hid every "false")."""
    return len(value) >= 4 and value.lower() not in NOT_SECRET and not value.replace(".", "", 1).isdigit()


def job_signal(text: object) -> str | None:
    """One of JOB_SIGNALS by its full name (``USR1``, ``usr1`` and ``SIGUSR1`` alike), or None.
    ASCII only: Unicode's case folding makes ``ſigusr1`` (long s) and ``ınt`` (dotless i) match."""
    name = text.upper() if isinstance(text, str) and text.isascii() else ""
    name = name if name.startswith("SIG") else "SIG" + name
    return name if name in JOB_SIGNALS else None


def default_client() -> str:
    """The user's own ssh wherever there is one (so every setting of theirs applies), else paramiko."""
    return "openssh" if shutil.which("ssh") else "fabric"


@dataclass(frozen=True)
class SSHSettings:
    """What the cluster file sets; unset values come from the SSH config file (HostName, User,
    Port, IdentityFile, ProxyJump), then OpenSSH's defaults."""

    user: str | None = None
    port: int | None = None  # None: the SSH config's Port, else 22
    identity_file: str | None = None
    known_hosts: str = "~/.ssh/known_hosts"
    connect_timeout: float = 10.0
    config_file: str | None = None  # None: ~/.ssh/config and /etc/ssh/ssh_config, as OpenSSH reads them
    # "openssh": the user's own `ssh` client runs the agent's pipe (every ssh_config setting applies),
    # the default wherever `ssh` is on PATH; "fabric": paramiko, for machines without one
    client: str = "openssh"
    known_hosts_set: bool = False  # the cluster file named known_hosts (else openssh uses its own config's)
    max_parallel: int = 10  # ssh connections set up at once (openssh): sshd's default MaxStartups begins at 10


@dataclass(frozen=True)
class SyncConfig:
    """`sync:`: copy a local directory to every node's workdir before launch (see sync.py)."""

    src: str  # absolute
    exclude: tuple[str, ...] = ()  # gitignore-syntax patterns, over every .gitignore
    gitignore: bool = True  # honor .gitignore files (and .git/info/exclude) under src
    line: int | None = None  # where the cluster file set it, for messages


@dataclass(frozen=True)
class NodeConfig:
    """One node as the user described it, with top-level defaults already applied."""

    rank: int
    host: str
    gpus: int | None  # None: `gpus: auto`, the count detected on the node (see resolve_gpus)
    addr: str
    transport: Transport
    python: str
    workdir: str | None
    env: Mapping[str, str]
    ssh: SSHSettings
    line: int | None = None
    setup: tuple[str, ...] = ()  # shell lines run before the agent, in the same bash (see transport)
    container: ContainerConfig | None = None  # the image the launcher runs in (containers.py)

    @property
    def label(self) -> str:
        return self.host


@dataclass(frozen=True)
class ClusterConfig:
    path: str
    nodes: tuple[NodeConfig, ...]
    master_addr: str
    master_port: int | None  # None: pick a free port on the master node
    orphan_timeout: float = 30.0
    stop_grace: float = 10.0
    stop_signal: str = "SIGTERM"  # what every rank gets first on a stop (the signal its script saves on)
    cluster_id: str = field(default="")
    hang_timeout: float | None = None  # off unless set
    startup_timeout: float | None = None  # launch to every rank's process group up (hang.py's default unless set)
    # "legacy": torchrun, passing --local_rank=N as torch.distributed.launch did; "none": no
    # torchrun, ddp-up starts the workers itself with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_* set
    launcher: str = "torchrun"
    secrets: tuple[str, ...] = DEFAULT_SECRETS  # name globs whose values are never shown
    sync: SyncConfig | None = None
    retention: float = 7 * 86400.0  # seconds a finished detached job's record and logs stay on its nodes
    restarts: int = 0  # after a failure, start the whole job again up to this many times (see attempts.py)
    restart_delay: float = 10.0  # seconds before the first restart; each later one waits longer
    no_restart_on_exit: tuple[int, ...] = ()  # a root cause's exit code a restart cannot fix: the run ends
    fetch: tuple[str, ...] = ()  # paths brought back from every node when the job ends (fetch.py)
    recoveries: int | None = None  # new attempts after a lost node or an outside stop (None: attempts.recovery_limit)
    spares: int = 0  # the last this many nodes stay idle, to replace a node that fails
    min_nodes: int | None = None  # without a free spare, go on with this many nodes or more (None: never fewer)
    # seconds a node away from a smaller run must answer before the job is stopped to take it back
    # (inf: never; it rejoins at the next restart the run makes anyway)
    rejoin_after: float = 600.0
    evict_after: float | None = None  # a node the straggler measure names this long is set aside (off unless set)
    nodes_command: str | None = None  # a program that lists the nodes, run again before each attempt (nodescommand.py)
    report: bool = True  # runs/<job>/timeline.jsonl and report.html, at each run's end (views/report.py)
    metrics: tuple | None = ()  # `metrics:`: None, off; else ((name or None, pattern), ...) read besides the default forms
    flight_recorder: bool = True  # torch's Flight Recorder on in every rank (node/watch/flight.py): the stuck collective, stragglers
    warm: bool | None = None  # fork every rank from an interpreter that imported torch already (node/launchers/warm.py); false: cold;
    # None: the default (plan.launch.warm_start)
    preload: tuple[str, ...] = ()  # warm: what that interpreter imports besides torch
    measure_gpus: bool = False  # before the launch, ddp-check --gpus's measure; a slow GPU stops it
    notify: tuple = ()  # notify.Target: who hears of the job's events (a URL's token is a secret)
    # the cluster file's text as it was read and parsed, once: the run's record is made from it
    source_text: str = field(default="", repr=False, compare=False)

    @property
    def active_count(self) -> int:
        """The nodes a job starts on: all but the spares."""
        return len(self.nodes) - self.spares

    def is_secret(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name.upper(), p.upper()) for p in self.secrets)

    @property
    def secret_values(self) -> frozenset[str]:
        """Values to mask wherever ddp-up prints (dry-run, logs, dashboard); short ones are left
        alone, since masking "1" everywhere would hide more than it protects."""
        env = {v for n in self.nodes for k, v in n.env.items() if self.is_secret(k) and maskable(v)}
        return frozenset(env | {part for t in self.notify for part in t.secrets()})

    @property
    def auto_gpus(self) -> list[NodeConfig]:
        """Nodes whose process count is the GPU count found on them at launch."""
        return [n for n in self.nodes if n.gpus is None]

    def with_addresses(self, hostnames: Mapping[str, str]) -> ClusterConfig:
        """Where a node's address is its `host` and that host is an SSH config alias, the other
        nodes (and torchrun) need the alias's HostName instead: ``hostnames`` maps one to the other."""
        def real(addr: str) -> str:
            return hostnames.get(addr, addr)

        nodes = tuple(replace(n, addr=real(n.addr)) if n.addr == n.host else n for n in self.nodes)
        return replace(self, nodes=nodes, master_addr=real(self.master_addr))

    def resolve_gpus(self, counts: Mapping[int, int]) -> ClusterConfig:
        """The same cluster with each `gpus: auto` node's detected count (by node rank)."""
        nodes = tuple(replace(n, gpus=counts[n.rank]) if n.gpus is None else n for n in self.nodes)
        return replace(self, nodes=nodes)


@dataclass(frozen=True)
class NodeSource:
    """Nodes given outside the cluster file (--hostfile, -H, --slurm), as ``nodes:`` entries."""

    name: str  # how the user gave them, for messages and the cluster id: "--hostfile hosts.txt"
    path: str  # a file to resolve relative paths against and name in errors ("" if none)
    nodes: list[dict]
    master_port: int | None = None  # a port the source implies (Slurm), unless the file sets one
    transport: str | None = None  # how the source's nodes are reached (Slurm: srun), unless the file says


def never(rejoin_after: float) -> bool:
    """`rejoin_after: never` (kept as infinity): a run grows back only at a restart it makes anyway."""
    return rejoin_after == float("inf")


def cluster_id_for(path: str) -> str:
    """Stable id of a cluster file (its real path), so ddp-kill can find jobs launched from it."""
    real = os.path.realpath(path)
    return hashlib.sha1(real.encode()).hexdigest()[:10]


def node_workdir(cfg: NodeConfig, local_cwd: str) -> str | None:
    """Where a node's job runs: its `workdir:`; a local node without one runs where the user is,
    like `torchrun` would; None: the remote user's home."""
    if cfg.workdir is None and cfg.transport == "local":
        return local_cwd
    return cfg.workdir


def quote_path(path: str) -> str:
    """Shell-quote a path but keep a leading ``~/`` meaning the remote user's home."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)
