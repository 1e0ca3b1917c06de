"""Cluster file -> validated, frozen config. The only module that sees raw YAML.

Every error names the file, the line and the key path (``cluster.yaml:7: nodes[1].gpus: ...``)
so a typo is fixed in seconds instead of showing up as a hang at rendezvous.
"""

from __future__ import annotations

import fnmatch
import hashlib
import math
import os
import re
import shutil
import sys
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Literal, Mapping

import yaml

from .errors import ConfigError

Transport = Literal["ssh", "local"]

SSH_KEYS = ("user", "port", "identity_file", "known_hosts", "connect_timeout", "config_file", "client", "max_parallel")
SSH_CLIENTS = ("fabric", "openssh")
# Keys valid at the top level and overridable per node.
SHARED_KEYS = ("python", "workdir", "env", "transport", "gpus", "setup")
NODE_KEYS = ("host", "addr", *SHARED_KEYS, *SSH_KEYS)
TOP_KEYS = ("nodes", "ssh", "master", "orphan_timeout", "stop_grace", "hang_timeout", "launcher", "env_file",
            "forward_env", "secrets", "sync", "retention", "restarts", "restart_delay", "spares", "min_nodes",
            *SHARED_KEYS)
SYNC_KEYS = ("src", "exclude", "gitignore")
# Names whose values are masked even if `secrets:` does not list them.
DEFAULT_SECRETS = ("*TOKEN*", "*SECRET*", "*PASSWORD*", "*PASSWD*", "*_KEY", "*API_KEY*", "*CREDENTIALS*")
LAUNCHERS = ("torchrun", "legacy", "none")
TRANSPORTS = ("ssh", "srun", "local")
MASTER_KEYS = ("addr", "port")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # always with fullmatch: `$` would accept "NAME\n"
MAX_YAML_NODES = 100_000  # a cluster file has hundreds; more is an alias bomb or not a cluster file


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
    cluster_id: str = field(default="")
    hang_timeout: float | None = None  # off unless set
    # "legacy": torchrun, passing --local_rank=N as torch.distributed.launch did; "none": no
    # torchrun, ddp-up starts the workers itself with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_* set
    launcher: str = "torchrun"
    secrets: tuple[str, ...] = DEFAULT_SECRETS  # name globs whose values are never shown
    sync: SyncConfig | None = None
    retention: float = 7 * 86400.0  # seconds a finished detached job's record and logs stay on its nodes
    restarts: int = 0  # after a failure, start the whole job again up to this many times (see attempts.py)
    restart_delay: float = 10.0  # seconds before the first restart; each later one waits longer
    spares: int = 0  # the last this many nodes stay idle, to replace a node that fails
    min_nodes: int | None = None  # without a free spare, go on with this many nodes or more (None: never fewer)

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
        return frozenset(v for n in self.nodes for k, v in n.env.items() if self.is_secret(k) and len(v) >= 4)

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


def load_cluster(path: str | None, source: NodeSource | None = None, forward: bool = True) -> ClusterConfig:
    """Read and validate a cluster file (optional when ``source`` gives the nodes); raise
    ConfigError naming file, line and key. ``forward=False`` (ddp-kill) leaves `forward_env:`,
    `env_file:` and `sync:` unresolved: stopping jobs must not depend on this shell having the
    job's tokens, or on files that only the launching machine has."""
    environ = os.environ if forward else None
    if path is None:
        assert source is not None, "nodes come from a cluster file or another source"
        return parse_cluster("", source.path or source.name, source, environ, local_files=forward)
    text = read_text(path, "cluster file")
    return parse_cluster(text, path, source, environ, local_files=forward)


def read_text(path: str, what: str) -> str:
    """A UTF-8 text file, or ConfigError naming the file (and the line of a byte that is not UTF-8)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ConfigError(path, None, "", f"cannot read {what}: {e.strerror}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise ConfigError(path, line, "", f"{what} is not UTF-8 text (byte 0x{data[e.start]:02x}); "
                                          "save it as UTF-8") from None


def parse_cluster(text: str, path: str = "<cluster>", source: NodeSource | None = None,
                  environ: Mapping[str, str] | None = None, local_files: bool = True) -> ClusterConfig:
    """``environ`` is where `forward_env:` takes values from (load_cluster: this process's);
    None: checked for form only, nothing forwarded. ``local_files=False`` reads no `env_file:`
    and checks no `sync:` source."""
    data, lines = _load_yaml(text, path)
    if source is not None:
        data = _with_source(data, lines, path, source)
    return _Validator(path, lines, environ, local_files).cluster(data)


def _with_source(data: Any, lines: dict[tuple, int], path: str, source: NodeSource) -> Any:
    """The cluster file's settings with the source's nodes (and its port, if the file sets none)."""
    data = {} if data is None else data
    if not isinstance(data, dict):
        return data  # the validator reports it
    if "nodes" in data:
        raise ConfigError(path, lines.get(("nodes",)), "nodes",
                          f"the nodes come from {source.name}: remove `nodes:` here or drop {source.name.split()[0]}")
    data = {**data, "nodes": source.nodes}
    if source.transport is not None and "transport" not in data:
        data["transport"] = source.transport
    if source.master_port is not None and "port" not in (data.get("master") or {}):
        master = data.get("master") if isinstance(data.get("master"), dict) else {}
        data["master"] = {**master, "port": source.master_port}
    return data


def cluster_id_for(path: str) -> str:
    """Stable id of a cluster file (its real path), so ddp-kill can find jobs launched from it."""
    real = os.path.realpath(path)
    return hashlib.sha1(real.encode()).hexdigest()[:10]


# --- YAML with line numbers -------------------------------------------------------------------

def _load_yaml(text: str, path: str) -> tuple[Any, dict[tuple, int]]:
    loader = yaml.SafeLoader(text)
    lines: dict[tuple, int] = {}
    try:
        root = loader.get_single_node()
        if root is not None:  # before constructing: merge keys (`<<: *defaults`) rewrite the nodes
            _index_lines(root, (), lines, path, set())
        data = loader.construct_document(root) if root is not None else None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark else None
        raise ConfigError(path, line, "", f"invalid YAML: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise ConfigError(path, None, "", f"invalid YAML: {e}") from None
    except RecursionError:
        raise ConfigError(path, None, "", "nested too deeply to be a cluster file") from None
    finally:
        loader.dispose()
    return data, lines


def _index_lines(node: yaml.Node, at: tuple, lines: dict[tuple, int], path: str, seen_nodes: set[int]) -> None:
    """The line of every key path; duplicate keys are errors. A node reached again through an
    alias is not walked again, so an alias bomb costs its size, not its expansion."""
    lines[at] = node.start_mark.line + 1
    if id(node) in seen_nodes:
        return
    seen_nodes.add(id(node))
    if len(seen_nodes) > MAX_YAML_NODES:
        raise ConfigError(path, node.start_mark.line + 1, _key_path(at),
                          f"more than {MAX_YAML_NODES:,} YAML nodes: not a cluster file")
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key_node, value_node in node.value:
            key = key_node.value
            line = key_node.start_mark.line + 1
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults`: later keys override it
                _index_lines(value_node, at, lines, path, seen_nodes)
                continue
            if not isinstance(key, str):
                raise ConfigError(path, line, _key_path(at), "a key must be a plain name")
            if key in seen:
                raise ConfigError(path, line, _key_path(at + (key,)),
                                  f"duplicate key (first set on line {seen[key]})")
            seen[key] = line
            _index_lines(value_node, at + (key,), lines, path, seen_nodes)
            lines[at + (key,)] = line
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _index_lines(item, at + (i,), lines, path, seen_nodes)


def _key_path(at: tuple) -> str:
    out = ""
    for part in at:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


# --- validation ---------------------------------------------------------------------------------

class _Validator:
    def __init__(self, path: str, lines: dict[tuple, int], environ: Mapping[str, str] | None,
                 local_files: bool = True):
        self.path = path
        self.lines = lines
        self.environ = environ
        self.local_files = local_files
        self.base_dir = os.path.dirname(os.path.abspath(path))
        self.base_env: dict[str, str] = {}  # env_file, then forward_env: under every node's env

    def error(self, at: tuple, message: str) -> ConfigError:
        line = None
        for cut in range(len(at), -1, -1):  # nearest located ancestor
            line = self.lines.get(at[:cut])
            if line is not None:
                break
        return ConfigError(self.path, line, _key_path(at), message)

    def cluster(self, data: Any) -> ClusterConfig:
        if data is None:
            raise self.error((), "the cluster file is empty; it needs at least a `nodes:` list")
        top = self.mapping(data, (), TOP_KEYS)
        ssh_top = self.mapping(top.get("ssh", {}), ("ssh",), SSH_KEYS)
        master = self.mapping(top.get("master", {}), ("master",), MASTER_KEYS)
        self.base_env = {**self.env_file(top.get("env_file")), **self.forwarded(top.get("forward_env", []))}
        raw_nodes = top.get("nodes")
        if raw_nodes is None:
            raise self.error(("nodes",), "missing: list the nodes, e.g. `nodes: [{host: gpu-a, gpus: 8}]`")
        if not isinstance(raw_nodes, list) or not raw_nodes:
            raise self.error(("nodes",), "must be a non-empty list of nodes")
        nodes = tuple(self.node(i, raw, top, ssh_top) for i, raw in enumerate(raw_nodes))
        self.check_unique(nodes)
        return ClusterConfig(
            path=self.path,
            nodes=nodes,
            master_addr=self.master_addr(master, nodes[0]),
            master_port=self.master_port(master),
            orphan_timeout=self.positive(top.get("orphan_timeout", 30), ("orphan_timeout",)),
            stop_grace=self.positive(top.get("stop_grace", 10), ("stop_grace",), allow_zero=True),
            cluster_id=cluster_id_for(self.path),
            hang_timeout=None if top.get("hang_timeout") is None else
            self.positive(top["hang_timeout"], ("hang_timeout",)),
            launcher=self.choice(top.get("launcher", "torchrun"), ("launcher",), LAUNCHERS),
            secrets=(*self.names(top.get("secrets", []), ("secrets",)), *DEFAULT_SECRETS),
            sync=self.sync(top.get("sync")),
            retention=self.duration(top.get("retention", "7d"), ("retention",)),
            **self.restart_policy(top, len(nodes)),
        )

    def restart_policy(self, top: dict, count: int) -> dict:
        """restarts, restart_delay, spares and min_nodes, each checked against the others."""
        spares = self.integer(top.get("spares", 0), ("spares",), 0)
        if spares >= count:
            raise self.error(("spares",), f"must leave at least one node to run on: {count} node(s) listed, "
                                          f"{spares} spare(s)")
        active = count - spares
        min_nodes = top.get("min_nodes")
        if min_nodes is not None:
            min_nodes = self.integer(min_nodes, ("min_nodes",), 1, active,
                                     hint=f"(the job starts on {active} node(s): the listed ones but the spares)")
        return dict(restarts=self.integer(top.get("restarts", 0), ("restarts",), 0),
                    restart_delay=self.positive(top.get("restart_delay", 10), ("restart_delay",), allow_zero=True),
                    spares=spares, min_nodes=min_nodes)

    def node(self, i: int, raw: Any, top: dict, ssh_top: dict) -> NodeConfig:
        at = ("nodes", i)
        own = self.mapping(raw, at, NODE_KEYS)
        if "host" not in own:
            raise self.error(at, "missing `host:` (SSH target: address, DNS name or ~/.ssh/config alias)")
        host = self.string(own["host"], at + ("host",))

        def pick(key: str, default: Any) -> tuple[Any, tuple]:
            if key in own:
                return own[key], at + (key,)
            if key in top:
                return top[key], (key,)
            return default, (key,)

        transport, t_at = pick("transport", "ssh")
        if transport not in TRANSPORTS:
            raise self.error(t_at, f"must be `ssh`, `srun` (inside a Slurm allocation) or `local`, got {transport!r}")
        gpus, g_at = pick("gpus", None)
        if gpus is None:
            raise self.error(at, "missing `gpus:` (number of processes to start on this node, >= 1, or `auto`)")
        python, p_at = pick("python", sys.executable if transport == "local" else "python3")
        workdir, w_at = pick("workdir", None)
        addr = own.get("addr", "127.0.0.1" if transport == "local" else host)
        return NodeConfig(
            rank=i,
            host=host,
            gpus=None if gpus == "auto" else self.integer(gpus, g_at, low=1, hint="or `auto`"),
            addr=self.string(addr, at + ("addr",)),
            transport=transport,
            python=self.string(python, p_at),
            workdir=None if workdir is None else self.string(workdir, w_at),
            env=self.env(top.get("env", {}), own.get("env", {}), at),
            ssh=self.ssh(own, ssh_top, at),
            line=self.lines.get(at),
            setup=self.commands(*pick("setup", [])),
        )

    def ssh(self, own: dict, ssh_top: dict, at: tuple) -> SSHSettings:
        def pick(key: str, default: Any) -> tuple[Any, tuple]:
            if key in own:
                return own[key], at + (key,)
            if key in ssh_top:
                return ssh_top[key], ("ssh", key)
            return default, ("ssh", key)

        user, u_at = pick("user", None)
        port, p_at = pick("port", None)
        ident, i_at = pick("identity_file", None)
        config_file, f_at = pick("config_file", None)
        known, k_at = pick("known_hosts", "~/.ssh/known_hosts")
        timeout, c_at = pick("connect_timeout", 10)
        client, cl_at = pick("client", default_client())
        parallel, mp_at = pick("max_parallel", 10)
        return SSHSettings(
            user=None if user is None else self.string(user, u_at),
            port=None if port is None else self.integer(port, p_at, low=1, high=65535),
            identity_file=None if ident is None else self.file_path(ident, i_at),
            known_hosts=self.file_path(known, k_at),
            connect_timeout=self.positive(timeout, c_at),
            config_file=None if config_file is None else self.existing_file(config_file, f_at),
            client=self.choice(client, cl_at, SSH_CLIENTS),
            max_parallel=self.integer(parallel, mp_at, low=1, high=1024),
            known_hosts_set="known_hosts" in own or "known_hosts" in ssh_top,
        )

    def commands(self, value: Any, at: tuple) -> tuple[str, ...]:
        return self.strings(value, at, "a shell command or a list of them, e.g. [source ~/venv/bin/activate]")

    def strings(self, value: Any, at: tuple, what: str) -> tuple[str, ...]:
        """A non-empty string or a list of them."""
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
            raise self.error(at, f"must be {what}")
        return tuple(value)

    def names(self, value: Any, at: tuple) -> list[str]:
        """A list of variable names or globs (``WANDB_*``)."""
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise self.error(at, "must be a list of variable names or globs, e.g. [WANDB_*, HF_TOKEN]")
        return value

    def forwarded(self, value: Any) -> dict[str, str]:
        """`forward_env:` from this machine's environment: named variables must be set here;
        a glob may match none. Never the whole environment."""
        found: dict[str, str] = {}
        patterns = self.names(value, ("forward_env",))
        if self.environ is None:
            return found
        for pattern in patterns:
            if not any(c in pattern for c in "*?["):
                if pattern not in self.environ:
                    raise self.error(("forward_env",), f"{pattern} is not set in this environment; set it "
                                                       "before running ddp-up, or remove it")
                found[pattern] = self.environ[pattern]
            elif pattern.strip("*") == "":
                raise self.error(("forward_env",), "refusing to forward the whole environment; name the variables")
            else:
                found.update({k: v for k, v in self.environ.items() if fnmatch.fnmatchcase(k, pattern)})
        return found

    def env_file(self, value: Any) -> dict[str, str]:
        """`env_file:` in dotenv form: NAME=value lines, `export ` allowed, # comments, quotes."""
        if value is None:
            return {}
        path = self.file_path(value, ("env_file",))
        if not self.local_files:
            return {}
        try:
            text = read_text(path, "env_file")
        except ConfigError as e:
            if e.line is not None:
                raise
            raise self.error(("env_file",), e.message) from None
        found = {}
        for number, raw in enumerate(text.splitlines(), start=1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            name, eq, val = line.removeprefix("export ").partition("=")
            name, val = name.strip(), val.strip()
            if not eq or not ENV_NAME.fullmatch(name):
                # The line is not echoed: it may hold a secret.
                raise ConfigError(path, number, "", "expected NAME=value (a letter or _ first, then letters, "
                                                    "digits, _), an `export ` prefix, a # comment or nothing")
            if len(val) >= 2 and val[0] == val[-1] and val[0] in "'\"":
                val = val[1:-1]
            found[name] = val
        return found

    def env(self, top_env: Any, node_env: Any, at: tuple) -> Mapping[str, str]:
        merged: dict[str, str] = dict(self.base_env)
        for raw, where in ((top_env, ("env",)), (node_env, at + ("env",))):
            if not isinstance(raw, dict):
                raise self.error(where, "must be a mapping of NAME: value")
            for name, value in raw.items():
                if not isinstance(name, str) or not ENV_NAME.fullmatch(name):
                    raise self.error(where + (name,), "is not a valid environment variable name")
                if value is None or isinstance(value, (dict, list)):
                    raise self.error(where + (name,), "must be a string or number")
                merged[name] = _env_text(value)
        return MappingProxyType(merged)

    def sync(self, value: Any) -> SyncConfig | None:
        """`sync: DIR`, or `sync: {src: DIR, exclude: [...], gitignore: true}`; DIR is relative to
        the cluster file. `sync: false` (or none) copies nothing."""
        if value is None or value is False:
            return None
        raw = {"src": value} if isinstance(value, str) else self.mapping(value, ("sync",), SYNC_KEYS)
        if "src" not in raw:
            raise self.error(("sync",), "missing `src:` (the local directory to copy to each node's workdir)")
        src = self.file_path(raw["src"], ("sync", "src") if isinstance(value, dict) else ("sync",))
        if self.local_files and not os.path.isdir(src):
            raise self.error(("sync",), f"{src} is not a directory (the local directory to copy to each workdir)")
        gitignore = raw.get("gitignore", True)
        if not isinstance(gitignore, bool):
            raise self.error(("sync", "gitignore"), f"must be true or false, got {gitignore!r}")
        exclude = self.strings(raw.get("exclude", []), ("sync", "exclude"),
                               "a gitignore-style pattern or a list of them, e.g. [data/, '*.ckpt']")
        return SyncConfig(src=os.path.normpath(src), exclude=exclude, gitignore=gitignore, line=self.lines.get(("sync",)))

    def master_addr(self, master: dict, first: NodeConfig) -> str:
        if "addr" in master:
            return self.string(master["addr"], ("master", "addr"))
        return first.addr

    def master_port(self, master: dict) -> int | None:
        port = master.get("port", "auto")
        if port == "auto":
            return None
        return self.integer(port, ("master", "port"), low=1, high=65535, hint="or `auto`")

    def check_unique(self, nodes: tuple[NodeConfig, ...]) -> None:
        seen: dict[tuple, NodeConfig] = {}
        for node in nodes:
            key = (node.transport, node.host, node.ssh.port or 22)
            if key in seen:
                first = seen[key]
                raise self.error(("nodes", node.rank, "host"),
                                 f"duplicate of nodes[{first.rank}] (line {first.line}): "
                                 f"list each node once and set `gpus:` to its process count")
            seen[key] = node

    # --- scalar checks ---

    def mapping(self, value: Any, at: tuple, allowed: tuple[str, ...]) -> dict:
        if not isinstance(value, dict):
            raise self.error(at, f"must be a mapping, got {_kind(value)}")
        for key in value:
            if key not in allowed:
                hint = _closest(str(key), allowed)
                raise self.error(at + (key,), "unknown key" + (f"; did you mean `{hint}`?" if hint else
                                 f"; allowed here: {', '.join(allowed)}"))
        return value

    def string(self, value: Any, at: tuple) -> str:
        if isinstance(value, bool) or not isinstance(value, (str, int, float)) or str(value) == "":
            raise self.error(at, f"must be a non-empty string, got {_kind(value)}")
        return str(value)

    def integer(self, value: Any, at: tuple, low: int, high: int | None = None, hint: str = "") -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (high and value > high):
            bound = f"between {low} and {high}" if high else f">= {low}"
            raise self.error(at, f"must be an integer {bound}{' ' + hint if hint else ''}, got {value!r}")
        return value

    def choice(self, value: Any, at: tuple, allowed: tuple[str, ...]) -> str:
        if value not in allowed:
            raise self.error(at, f"must be one of {', '.join(f'`{a}`' for a in allowed)}, got {value!r}")
        return value

    def positive(self, value: Any, at: tuple, allow_zero: bool = False) -> float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or value < 0 or (value == 0 and not allow_zero):
            raise self.error(at, f"must be a number of seconds {'>= 0' if allow_zero else '> 0'}, got {value!r}")
        return float(value)

    def duration(self, value: Any, at: tuple) -> float:
        """Seconds, as a number or with a unit: 90, "30m", "12h", "7d"."""
        units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
        if isinstance(value, str) and value[-1:] in units:
            try:
                value = float(value[:-1]) * units[value[-1]]
            except ValueError:
                pass
        if isinstance(value, str):
            raise self.error(at, f"must be a duration such as 7d, 12h, 30m or a number of seconds, got {value!r}")
        return self.positive(value, at, allow_zero=True)

    def file_path(self, value: Any, at: tuple) -> str:
        text = os.path.expanduser(self.string(value, at))
        return text if os.path.isabs(text) else os.path.join(self.base_dir, text)

    def existing_file(self, value: Any, at: tuple) -> str:
        path = self.file_path(value, at)
        if not os.path.exists(path) or os.path.isdir(path):  # /dev/null is fine: "no config"
            raise self.error(at, f"{path} does not exist (or is a directory): fix the path, or remove the key")
        return path


def _env_text(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def _kind(value: Any) -> str:
    if value is None:
        return "nothing"
    return {dict: "a mapping", list: "a list", str: f"{value!r}"}.get(type(value), repr(value))


def _closest(word: str, options: tuple[str, ...]) -> str | None:
    import difflib

    match = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return match[0] if match else None
