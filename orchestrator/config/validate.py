"""A cluster file's data (YAML, with the line of every key) -> the frozen config of config.py.

The settings are tables: each key, the check its value must pass (with its range or choices) and
its default (``RULES``, ``SSH_RULES``); a node's setting is its own, else the top level's, else the
default. Every error names the file, the line and the key path, from the nearest located key.
"""

from __future__ import annotations

import fnmatch
import math
import os
import re
import sys
from types import MappingProxyType
from typing import Any, Callable, Mapping, NamedTuple

from ..errors import ConfigError
from ..ownfiles import NO_NAME_OF_ITS_OWN, fetch_name
from ..node.probes.facts import IFNAME_VARS
from . import notify
from .cluster import (DEFAULT_SECRETS, JOB_SIGNALS, ClusterConfig, NodeConfig, SSHSettings, SyncConfig, cluster_id_for,
                      default_client, job_signal)
from .containers import container
from .metricpatterns import checked_patterns
from .hostlists import host_problem
from .keyhints import unknown_key_hint
from .reading import key_path, read_text
from .values import ENV_NAME, ENV_VALUE_TYPES, NUL_VALUE, env_text, parse_duration, read_dotenv, whole

SSH_CLIENTS = ("fabric", "openssh")
MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,99}(\.[A-Za-z_][A-Za-z0-9_]{0,99}){0,9}")
# Keys valid at the top level and overridable per node (and, on a node, `host`, `addr` and `ssh:`'s keys).
MOST_PROCS = 1024  # processes on one node (`gpus:`): a larger number is a typo, not a machine
SHARED_KEYS = ("python", "workdir", "env", "transport", "gpus", "setup", "container")
TOP_KEYS = ("nodes", "nodes_command", "ssh", "master", "orphan_timeout", "stop_grace", "stop_signal", "hang_timeout", "startup_timeout",
            "launcher", "env_file",
            "forward_env", "secrets", "sync", "retention", "restarts", "restart_delay", "no_restart_on_exit", "recoveries",
            "spares", "min_nodes", "rejoin_after", "evict_after", "flight_recorder", "report", "notify", "fetch", "warm", "preload", "measure_gpus",
            "metrics", *SHARED_KEYS)
SYNC_KEYS = ("src", "exclude", "gitignore")
LAUNCHERS = ("torchrun", "legacy", "none", "accelerate")
TRANSPORTS = ("ssh", "srun", "local")
MASTER_KEYS = ("addr", "port")


# The longest timeout or delay taken: a longer one is a typo, and past what a wait can be given
# (threading and select refuse one of 1e10 s with OverflowError, deep inside a running job).
LONGEST = 30 * 86400.0
LONGEST_RETENTION = 3650 * 86400.0
MOST_RESTARTS = 1000


class Rule(NamedTuple):
    """One setting: the Checks method its value must pass, with these arguments, and its default
    (a callable is called for it; None: unset, and not checked)."""

    check: str
    default: Any = None
    args: Mapping[str, Any] = MappingProxyType({})


def rule(check: str, default: Any = None, **args: Any) -> Rule:
    return Rule(check, default, MappingProxyType(args))


RULES = {  # top-level settings that are one checked value each
    "orphan_timeout": rule("positive", 30),
    "stop_grace": rule("positive", 10, allow_zero=True),
    "stop_signal": rule("signal_name", "SIGTERM"),
    "hang_timeout": rule("positive"),
    "startup_timeout": rule("positive"),
    "launcher": rule("choice", "torchrun", allowed=LAUNCHERS),
    "retention": rule("duration", "7d"),
    "restarts": rule("integer", 0, low=0, high=MOST_RESTARTS),
    "restart_delay": rule("positive", 10, allow_zero=True),
    "no_restart_on_exit": rule("exit_codes", ()),
    "recoveries": rule("integer", None, low=0, high=MOST_RESTARTS),
    "spares": rule("integer", 0, low=0),
    "rejoin_after": rule("positive_or_never", "10m", allow_zero=True),
    "evict_after": rule("positive"),
    "flight_recorder": rule("boolean", True),
    "report": rule("boolean", True),
    "fetch": rule("fetch_paths", ()),
    "warm": rule("boolean"),  # left out: on where it pays (plan.launch.warm_start)
    "preload": rule("module_names", ()),
    "measure_gpus": rule("boolean", False),
}
SSH_RULES = {  # `ssh:`, or the same keys on a node
    "user": rule("string"),
    "port": rule("integer", low=1, high=65535),
    "identity_file": rule("file_path"),
    "known_hosts": rule("file_path", "~/.ssh/known_hosts"),
    "connect_timeout": rule("positive", 10),
    "config_file": rule("existing_file"),
    "client": rule("choice", default_client, allowed=SSH_CLIENTS),
    "max_parallel": rule("integer", 10, low=1, high=1024),
}
NODE_KEYS = ("host", "addr", *SHARED_KEYS, *SSH_RULES)


class Checks:
    """Scalar checks: each returns the value as the config holds it, or raises ConfigError at ``at``."""

    def __init__(self, path: str, lines: dict[tuple, int]):
        self.path = path
        self.lines = lines
        self.base_dir = os.path.dirname(os.path.abspath(path))

    def error(self, at: tuple, message: str) -> ConfigError:
        line = None
        for cut in range(len(at), -1, -1):  # nearest located ancestor
            line = self.lines.get(at[:cut])
            if line is not None:
                break
        return ConfigError(self.path, line, key_path(at), message)

    def apply(self, rules: Mapping[str, Rule], pick: Callable[[str], tuple[Any, tuple] | None],
              default_at: Callable[[str], tuple]) -> dict[str, Any]:
        """Every rule's checked value: ``pick(key)`` gives (value, where) if the file sets it."""
        values = {}
        for key, (check, default, args) in rules.items():
            picked = pick(key)  # an empty key (`restarts:`) takes its default, as the schema says
            value, at = picked if picked and picked[0] is not None else (default() if callable(default) else default,
                                                                         default_at(key))
            values[key] = None if value is None else getattr(self, check)(value, at, **args)
        return values

    def mapping(self, value: Any, at: tuple, allowed: tuple[str, ...]) -> dict:
        if not isinstance(value, dict):
            raise self.error(at, f"must be a mapping, got {_kind(value)}")
        for key in value:
            if key not in allowed:
                raise self.error(at + (key,), "unknown key; " + unknown_key_hint(str(key), at, allowed, tuple(SSH_RULES)))
        return value

    def string(self, value: Any, at: tuple) -> str:
        if isinstance(value, bool) or not isinstance(value, (str, int, float)) or str(value) == "":
            raise self.error(at, f"must be a non-empty string, got {_kind(value)}")
        return str(value)

    def integer(self, value: Any, at: tuple, low: int, high: int | None = None, hint: str = "") -> int:
        number = whole(value)
        if number is None or number < low or (high and number > high):
            bound = f"between {low} and {high}" if high else f">= {low}"
            raise self.error(at, f"must be an integer {bound}{' ' + hint if hint else ''}, got {value!r}")
        return number

    def exit_codes(self, value: Any, at: tuple) -> tuple[int, ...]:
        """A list of exit codes, 1 to 255 (a rank's exit status that a restart cannot fix)."""
        codes = [whole(v) for v in value] if isinstance(value, (list, tuple)) else [None]
        if not all(c is not None and 1 <= c <= 255 for c in codes):
            raise self.error(at, f"must be a list of exit codes from 1 to 255, e.g. [2, 3], got {value!r}")
        return tuple(codes)

    def fetch_paths(self, value: Any, at: tuple) -> tuple[str, ...]:
        """What to bring back from every node when the job ends: a path or a list of them (each
        relative to the node's workdir, or absolute), as ddp-fetch takes them."""
        if isinstance(value, (list, tuple)) and not value:
            return ()
        paths = self.strings(value, at, "a path on the nodes or a list of them, e.g. [ckpt, logs/metrics.json]")
        if any("\0" in p for p in paths):
            raise self.error(at, NUL_VALUE)
        names: dict[str, str] = {}
        for path in paths:
            name = fetch_name(path)
            if name is None or name in names:
                raise self.error(at, f"{path!r} {NO_NAME_OF_ITS_OWN}" if name is None else
                                 f"{names[name]!r} and {path!r} would both come back as <node>/{name}: fetch their folder")
            names[name] = path
        return paths

    def module_names(self, value: Any, at: tuple) -> tuple[str, ...]:
        """Python modules to import before the ranks start (warm start), as `import NAME` takes them."""
        names = [] if isinstance(value, (list, tuple)) and not value else \
            self.strings(value, at, "a list of Python modules, e.g. [lightning, transformers]")
        bad = next((n for n in names if not MODULE_NAME.fullmatch(n)), None)
        if bad is not None:
            raise self.error(at, f"{bad!r} is not a module name as `import` takes it, e.g. lightning or torch.nn")
        return tuple(names)

    def signal_name(self, value: Any, at: tuple) -> str:
        """A stop signal a script may save its work on: SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1 or
        SIGUSR2 (``USR1`` and lower case too), as its canonical name."""
        name = job_signal(value)
        if name is None:
            raise self.error(at, f"must be one of {', '.join(JOB_SIGNALS)} (the signal your script saves its "
                                 f"work on), got {value!r}")
        return name

    def boolean(self, value: Any, at: tuple) -> bool:
        if not isinstance(value, bool):
            raise self.error(at, f"must be true or false, got {value!r}")
        return value

    def choice(self, value: Any, at: tuple, allowed: tuple[str, ...]) -> str:
        if value not in allowed:
            raise self.error(at, f"must be one of {', '.join(f'`{a}`' for a in allowed)}, got {value!r}")
        return value

    def positive(self, value: Any, at: tuple, allow_zero: bool = False, most: float = LONGEST) -> float:
        """Seconds, as a number or with a unit (90, "90s", "5m", "12h", "7d"): every duration takes both."""
        seconds = parse_duration(value)
        if seconds is None or seconds < 0 or (seconds == 0 and not allow_zero):
            raise self.error(at, f"must be a number of seconds {'>= 0' if allow_zero else '> 0'}, or a duration "
                                 f"such as 90s, 5m, 12h or 7d, got {value!r}")
        if seconds > most:
            raise self.error(at, f"must be at most {most:.0f} seconds ({most / 86400:g} days), got {value!r}")
        return seconds

    def positive_or_never(self, value: Any, at: tuple, allow_zero: bool = False) -> float:
        """A duration, or ``never`` (infinite)."""
        if value == "never":
            return math.inf
        seconds = parse_duration(value)
        if seconds is None or seconds < 0 or (seconds == 0 and not allow_zero) or seconds > LONGEST:
            raise self.error(at, f"must be a duration such as 90s, 10m or 2h (at most {LONGEST / 86400:g} days), "
                                 f"or never, got {value!r}")
        return seconds

    def duration(self, value: Any, at: tuple) -> float:
        return self.positive(value, at, allow_zero=True, most=LONGEST_RETENTION)

    def file_path(self, value: Any, at: tuple) -> str:
        text = os.path.expanduser(self.string(value, at))
        return text if os.path.isabs(text) else os.path.join(self.base_dir, text)

    def existing_file(self, value: Any, at: tuple) -> str:
        path = self.file_path(value, at)
        if not os.path.exists(path) or os.path.isdir(path):  # /dev/null is fine: "no config"
            raise self.error(at, f"{path} does not exist (or is a directory): fix the path, or remove the key")
        return path

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


class Validator(Checks):
    """The cluster file's structure: the top level, each node (its own settings over the top
    level's), the environment every node gets, `sync:`, the master, the restart policy."""

    def __init__(self, path: str, lines: dict[tuple, int], environ: Mapping[str, str] | None,
                 local_files: bool = True):
        super().__init__(path, lines)
        self.environ = environ
        self.local_files = local_files
        self.base_env: dict[str, str] = {}  # env_file, then forward_env: under every node's env

    def cluster(self, data: Any) -> ClusterConfig:
        if data is None:
            raise self.error((), "the cluster file is empty; it needs at least a `nodes:` list")
        top = self.mapping(data, (), TOP_KEYS)
        ssh_top = self.mapping(top.get("ssh", {}), ("ssh",), tuple(SSH_RULES))
        master = self.mapping(top.get("master", {}), ("master",), MASTER_KEYS)
        self.base_env = {**self.env_file(top.get("env_file")), **self.forwarded(top.get("forward_env", []))}
        raw_nodes = top.get("nodes")
        if raw_nodes is None:
            raise self.error(("nodes",), "missing: list the nodes, e.g. `nodes: [{host: gpu-a, gpus: 8}]`")
        if not isinstance(raw_nodes, list) or not raw_nodes:
            raise self.error(("nodes",), "must be a non-empty list of nodes")
        nodes = tuple(self.node(i, raw, top, ssh_top) for i, raw in enumerate(raw_nodes))
        self.check_unique(nodes)
        settings = self.apply(RULES, lambda key: (top[key], (key,)) if key in top else None, lambda key: (key,))
        return ClusterConfig(
            path=self.path, nodes=nodes, cluster_id=cluster_id_for(self.path),
            master_addr=self.string(master["addr"], ("master", "addr")) if "addr" in master else nodes[0].addr,
            master_port=self.master_port(master),
            secrets=(*self.names(top.get("secrets", []), ("secrets",)), *DEFAULT_SECRETS),
            sync=self.sync(top.get("sync")),
            min_nodes=self.spared(top, len(nodes), settings),
            nodes_command=top.get("nodes_command"),  # run already, and checked (clusterfile._command_source)
            notify=notify.targets(top.get("notify"), lambda at, why: self.error(("notify", *at), why)),
            metrics=self.metrics(top.get("metrics")), **settings)

    def metrics(self, value: Any) -> tuple | None:
        items, at, why = checked_patterns(value)
        if why:
            raise self.error(("metrics", *at), why)
        return items

    def spared(self, top: dict, count: int, settings: dict) -> int | None:
        """`min_nodes:` (see min_nodes), and `evict_after:` only where the run can do without a node."""
        least = self.min_nodes(top, count, settings["spares"])
        if settings["evict_after"] is not None and not settings["spares"] and (least is None or least >= count):
            raise self.error(("evict_after",), "sets a slow node aside, but the run cannot do without one: add "
                                               "`spares: 1`, or `min_nodes:` below the node count")
        return least

    def min_nodes(self, top: dict, count: int, spares: int) -> int | None:
        """`min_nodes:`, checked against the nodes the job starts on (and `spares:` against the count)."""
        if spares >= count:
            raise self.error(("spares",), f"must leave at least one node to run on: {count} node(s) listed, "
                                          f"{spares} spare(s)")
        active = count - spares
        if top.get("min_nodes") is None:
            return None
        return self.integer(top["min_nodes"], ("min_nodes",), 1, active,
                            hint=f"(the job starts on {active} node(s): the listed ones but the spares)")

    def node(self, i: int, raw: Any, top: dict, ssh_top: dict) -> NodeConfig:
        at = ("nodes", i)
        own = self.mapping(raw, at, NODE_KEYS)
        if "host" not in own:
            raise self.error(at, "missing `host:` (SSH target: address, DNS name or ~/.ssh/config alias)")
        host = self.string(own["host"], at + ("host",))
        why = host_problem(host)
        if why:
            raise self.error(at + ("host",), f"the host {why}: give an address, a DNS name or an SSH config alias")

        def pick(key: str, default: Any) -> tuple[Any, tuple]:
            return self.own_or_top(own, at, top, (), key) or (default, (key,))

        transport, t_at = pick("transport", "ssh")
        if transport not in TRANSPORTS:
            raise self.error(t_at, f"must be `ssh`, `srun` (inside a Slurm allocation) or `local`, got {transport!r}")
        gpus, g_at = pick("gpus", None)
        if gpus is None:
            raise self.error(at, "missing `gpus:` (number of processes to start on this node, >= 1, or `auto`)")
        python, p_at = pick("python", sys.executable if transport == "local" else "python3")
        workdir, w_at = pick("workdir", None)
        ssh = self.apply(SSH_RULES, lambda key: self.own_or_top(own, at, ssh_top, ("ssh",), key),
                         lambda key: ("ssh", key))
        return NodeConfig(
            rank=i, host=host, transport=transport, line=self.lines.get(at),
            gpus=None if gpus == "auto" else self.integer(gpus, g_at, low=1, high=MOST_PROCS, hint="or `auto`"),
            addr=self.string(own.get("addr", "127.0.0.1" if transport == "local" else host), at + ("addr",)),
            python=self.string(python, p_at),
            workdir=None if workdir is None else self.string(workdir, w_at),
            env=self.env(top.get("env", {}), own.get("env", {}), at),
            ssh=SSHSettings(**ssh, known_hosts_set="known_hosts" in own or "known_hosts" in ssh_top),
            setup=self.strings(*pick("setup", []), "a shell command or a list of them, e.g. "
                                                   "[source ~/venv/bin/activate]"),
            container=self.container(*pick("container", None), transport))

    def container(self, value: Any, at: tuple, transport: str):
        return container(value, transport, lambda below, why: self.error(at + below, why))

    @staticmethod
    def own_or_top(own: dict, at: tuple, top: dict, top_at: tuple, key: str) -> tuple[Any, tuple] | None:
        """A node's setting (value, where): its own, else the shared one, else None (the default)."""
        if key in own:
            return own[key], at + (key,)
        if key in top:
            return top[key], top_at + (key,)
        return None

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
        """`env_file:` in dotenv form (see read_dotenv); not read where local files are not."""
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
        return read_dotenv(text, path)

    def env(self, top_env: Any, node_env: Any, at: tuple) -> Mapping[str, str]:
        merged: dict[str, str] = dict(self.base_env)
        for raw, where in ((top_env, ("env",)), (node_env, at + ("env",))):
            if not isinstance(raw, dict):
                raise self.error(where, "must be a mapping of NAME: value")
            for name, value in raw.items():
                if not isinstance(name, str) or not ENV_NAME.fullmatch(name):
                    raise self.error(where + (name,), "is not a valid environment variable name")
                if not isinstance(value, ENV_VALUE_TYPES):  # a set or !!binary is no text to pass on
                    raise self.error(where + (name,), "must be a string or number")
                if "\0" in env_text(value):
                    raise self.error(where + (name,), NUL_VALUE)
                if name in IFNAME_VARS and any(part != part.strip() for part in env_text(value).split(",")):
                    raise self.error(where + (name,), f"interface names with spaces ({env_text(value)!r}): gloo and "
                                                      "NCCL read them as written; remove the spaces")
                merged[name] = env_text(value)
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


def _kind(value: Any) -> str:
    if value is None:
        return "nothing"
    return {dict: "a mapping", list: "a list", str: f"{value!r}"}.get(type(value), repr(value))
