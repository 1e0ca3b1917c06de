"""The cluster file -> the validated, frozen config (config.py): the only module that sees raw YAML,
with nodes from elsewhere (--hostfile, -H, --slurm) merged in.

Every error names the file, the line and the key path (``cluster.yaml:7: nodes[1].gpus: ...``)
so a typo is fixed in seconds instead of showing up as a hang at rendezvous.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Mapping

import yaml

from ..errors import ConfigError
from .cluster import ClusterConfig, NodeSource
from .masking import mask_values
from .nodescommand import listed_nodes
from .reading import load_yaml, read_text
from .validate import Validator


def load_cluster(path: str | None, source: NodeSource | None = None, forward: bool = True,
                 recorded: Recorded | None = None) -> ClusterConfig:
    """Read and validate a cluster file (optional when ``source`` gives the nodes); raise
    ConfigError naming file, line and key. ``forward=False`` (ddp-kill) leaves `forward_env:`,
    `env_file:` and `sync:` unresolved: stopping jobs must not depend on this shell having the
    job's tokens, or on files that only the launching machine has. ``recorded``: see Recorded."""
    environ = os.environ if forward else None
    if path is None:
        assert source is not None, "nodes come from a cluster file or another source"
        return parse_cluster("", source.path or source.name, source, environ, local_files=forward)
    text = read_text(path, "cluster file")
    return parse_cluster(text, path, source, environ, local_files=forward, recorded=recorded)


@dataclasses.dataclass(frozen=True)
class Recorded:
    """The nodes that jobs started from a `nodes_command:` file recorded at their launch
    (run/record.write_nodes), for a command about those jobs: with ``ask``, the program is run
    too, for nodes that are new since, and its failure is said (``note``), never raised; without,
    the record alone (a command about one job: the program can only name other nodes)."""

    nodes: list[dict]
    ask: bool = False
    note: Callable[[str], None] = lambda text: None


def parse_cluster(text: str, path: str = "<cluster>", source: NodeSource | None = None,
                  environ: Mapping[str, str] | None = None, local_files: bool = True,
                  recorded: Recorded | None = None) -> ClusterConfig:
    """``environ`` is where `forward_env:` takes values from (load_cluster: this process's);
    None: checked for form only, nothing forwarded. ``local_files=False`` reads no `env_file:`
    and checks no `sync:` source."""
    data, lines = load_yaml(text, path)
    source = _command_source(data, lines, path, source, recorded)
    if source is not None:
        data = _with_source(data, lines, path, source)
    return dataclasses.replace(Validator(path, lines, environ, local_files).cluster(data), source_text=text)


def relisted(config: ClusterConfig) -> ClusterConfig:
    """The cluster as its `nodes_command:` lists it now: the file's text as it was read at the
    launch, the program run again (ConfigError as at the launch)."""
    return parse_cluster(config.source_text, config.path, environ=os.environ)


def _command_source(data: Any, lines: dict[tuple, int], path: str, source: NodeSource | None,
                    recorded: Recorded | None = None) -> NodeSource | None:
    """The nodes `nodes_command:` lists (run now), where the file has one; with ``recorded``, the
    jobs' own (see Recorded)."""
    command = data.get("nodes_command") if isinstance(data, dict) else None
    if command is None:
        return source
    if not isinstance(command, str) or not command.strip():
        raise ConfigError(path, lines.get(("nodes_command",)), "nodes_command",
                          f"must be a command line that prints the nodes, got {command!r}")
    if source is not None:
        raise ConfigError(path, lines.get(("nodes_command",)), "nodes_command",
                          f"the nodes come from {source.name}: remove `nodes_command:` here or drop "
                          f"{source.name.split()[0]}")
    if recorded is None:
        return NodeSource("nodes_command", path, listed_nodes(command, path, lines.get(("nodes_command",))))
    listed: list[dict] = []
    if recorded.ask:
        try:
            listed = listed_nodes(command, path, lines.get(("nodes_command",)))
        except ConfigError as e:
            recorded.note(f"{e.render()}; going on with the nodes the jobs started from it recorded")
    hosts = {node["host"] for node in recorded.nodes}
    return NodeSource("nodes_command", path, [*recorded.nodes, *(n for n in listed if n["host"] not in hosts)])


def _with_source(data: Any, lines: dict[tuple, int], path: str, source: NodeSource) -> Any:
    """The cluster file's settings with the source's nodes (and its port, if the file sets none)."""
    data = {} if data is None else data
    if not isinstance(data, dict):
        return data  # the validator reports it
    if "nodes" in data:
        raise ConfigError(path, lines.get(("nodes",)), "nodes",
                          f"the nodes come from {source.name}: remove `nodes:` here or drop {source.name.split()[0]}")
    data = {**data, "nodes": source.nodes}
    if any("gpus" not in node for node in source.nodes) and "gpus" not in data:
        data["gpus"] = "auto"  # the source gives no count, and the settings file none either: ask each node
    if source.transport is not None and "transport" not in data:
        data["transport"] = source.transport
    if source.master_port is not None and "port" not in (data.get("master") or {}):
        master = data.get("master") if isinstance(data.get("master"), dict) else {}
        data["master"] = {**master, "port": source.master_port}
    return data


def masked_copy(text: str, secrets) -> str:
    """The cluster file for the run's record: what was parsed, with every secret masked as data
    (a secret written as a YAML escape, or folded over lines, is one string once parsed), dumped
    as YAML again. Its comments are not kept; its values are, where no secret is in them."""
    data, _ = load_yaml(text, "<cluster>")
    return yaml.safe_dump(mask_values(data, secrets), sort_keys=False, allow_unicode=True)
