"""The cluster file's JSON Schema, written from the validator's own tables (validate.py), so that an
editor (VS Code's YAML extension, any JSON Schema client) completes and checks a cluster.yaml with
the keys ddp-up takes, no more and no fewer. `ddp-up --schema` prints it; the package ships the
same text as ``cluster.schema.json`` (a test keeps the two one).

The validator stays the judge: the schema says the shapes (types, allowed values, bounds), the
validator also what a schema cannot (a path that exists, a job signal's spelling, a port free).
"""

from __future__ import annotations

import json
from typing import Any

import yaml

from .cluster import JOB_SIGNALS
from .validate import (LONGEST, LONGEST_RETENTION, MODULE_NAME, MOST_PROCS, NODE_KEYS, RULES, SSH_RULES, TOP_KEYS, TRANSPORTS,
                       Rule)
from ..node.launchers.container import PULLS, RUNTIMES
from ..node.supervise.notify import EVENTS
from ..ownfiles import FETCH_PATH
from .containers import MOUNT_OPTIONS
from .hostlists import HOST_MOST
from .values import DURATION_PATTERN, ENV_NAME

SCHEMA_URL = "https://json-schema.org/draft/2020-12/schema"
# Each shape below is the validator's rule of the same name, said as JSON Schema (validate.Checks).
LINE = {"type": "string", "pattern": r"\S"}  # Checks.strings: text that is not only blanks
STRINGS = {"anyOf": [LINE, {"type": "array", "items": LINE}]}
NAMES = {"type": "array", "items": {"type": "string", "minLength": 1}}  # Checks.names
STRING = {"type": ["string", "number"], "minLength": 1}  # Checks.string: a number is its text
# hostlists.host_problem: no blank or control character, no '-' first (ssh would take it for an option),
# at most HOST_MOST characters
HOST = {"type": ["string", "number"], "pattern": "^[^\\s\\x00-\\x1f\\x7f-][^\\s\\x00-\\x1f\\x7f]*$", "minimum": 0,
        "maxLength": HOST_MOST}
# YAML's .nan passes every bound (each comparison with it is false), and JSON cannot name it: NaN is
# the one number a checker finds both <= 0 and > 0, so this refuses it and nothing else
NOT_NAN = {"not": {"allOf": [{"maximum": 0}, {"exclusiveMinimum": 0}]}}
ENV = {"type": "object", "propertyNames": {"pattern": f"^{ENV_NAME.pattern}$"},
       "additionalProperties": {"type": ["string", "number", "boolean"]}}


def duration(allow_zero: bool, most: float) -> dict[str, Any]:
    """Checks.positive: seconds as a number within its bounds, or as text with a unit (whose bounds
    the validator alone checks: a pattern cannot compare)."""
    number = {"type": "number", "minimum" if allow_zero else "exclusiveMinimum": 0, "maximum": most, **NOT_NAN}
    return {"anyOf": [number, {"type": "string", "pattern": DURATION_PATTERN}],
            "description": "seconds, or with a unit: 90, 90s, 5m, 12h, 7d"}


def signal_pattern() -> str:
    """Checks.signal_name: a job signal's name, with or without SIG, in either case (ASCII only)."""
    def either_case(text: str) -> str:
        return "".join(f"[{c.upper()}{c.lower()}]" if c.isalpha() else c for c in text)
    return f"^({either_case('SIG')})?({'|'.join(either_case(name[3:]) for name in JOB_SIGNALS)})$"

# What each key is, in a line (the reference shows these; a key without one fails a test).
MEANING = {
    "nodes": "the machines, in node-rank order: host and gpus each, and any shared key of their own",
    "ssh": "how to reach the nodes (your ssh config applies first)",
    "master": "the rendezvous address and port (default: the first node's address, a free port)",
    "orphan_timeout": "a node's agent unheard this long counts as lost, and stops its part by itself",
    "stop_grace": "how long every rank gets to save and exit after the stop signal, before SIGKILL",
    "stop_signal": "the signal the job is stopped with (the one your script saves its work on)",
    "hang_timeout": "no output from any rank for this long: stacks are dumped, the job is stopped as hung",
    "startup_timeout": "how long a rank may take to reach init_process_group",
    "launcher": "what starts the ranks on each node",
    "env_file": "a file of NAME=value lines for every rank (its values are secrets)",
    "forward_env": "variables of this shell passed to every rank (globs allowed; values are secrets)",
    "secrets": "more variable names whose values are masked everywhere (any name holding KEY, PASS, TOKEN, SECRET, "
               "CREDENTIAL or AUTH is masked without it)",
    "sync": "copy this folder to every node's workdir before the launch (changed files only)",
    "retention": "how long a finished detached job's records stay on its nodes",
    "restarts": "new attempts after the job's own failures",
    "restart_delay": "the wait before attempt N is N times this",
    "no_restart_on_exit": "exit codes that end the run whatever restarts are left",
    "recoveries": "new attempts after a node lost or a stop from outside the job",
    "spares": "the last N nodes wait, and take a failed node's place; fewer than the nodes listed (checked when "
              "the file is read)",
    "evict_after": "set aside a node that arrives last at the collectives this long (a spare takes its place, or the "
                   "run shrinks as min_nodes allows); off unless set; needs `spares:`, or `min_nodes:` below the "
                   "node count (checked when the file is read)",
    "nodes_command": "a program that prints the nodes (`HOST slots=N` lines) instead of `nodes:`; run again "
                     "before each attempt: new nodes are spares, vanished ones are out",
    "min_nodes": "go on with fewer nodes, down to this many, when no spare is left; at most the nodes the job "
                 "starts on, the listed ones but the spares (checked when the file is read)",
    "rejoin_after": "a lost node that answers again this long stops a smaller run, which restarts at the larger size; "
                    "never: it rejoins at the next restart",
    "flight_recorder": "torch's Flight Recorder in every rank: the stuck collective, stragglers",
    "report": "keep the run's timeline and write runs/<job>/report.html, a page of charts, at its end",
    "metrics": "the numbers ranks print, kept as metrics (runs/<job>/metrics.csv, charted on the page): false: none; "
               "a list of patterns reads more forms besides the default ones: a regular expression with groups "
               "(?P<name>...) (or `name:`), (?P<value>...) and optionally (?P<step>...), without backreferences, "
               "lookarounds, nested repeats or more than one unbounded repeat",
    "notify": "where the job's events go: Apprise URLs (a string, or `url:`), a webhook, a command; each with "
              "`on:`, the events it gets",
    "fetch": "paths brought back from every node when the job ends, into runs/<job>/fetched/",
    "warm": "fork every rank from an interpreter on its node that imported torch before the launch; false: the cold start; "
            "left out: on under launcher: torchrun or with preload:, off otherwise",
    "preload": "warm: modules that interpreter imports too, besides torch",
    "measure_gpus": "before the launch, measure every GPU (as ddp-check --gpus) and refuse one far slower than its peers",
    "python": "the interpreter on the node",
    "workdir": "where the job runs on the node",
    "env": "variables for every rank",
    "transport": "how the node is reached",
    "gpus": "processes on the node (one per GPU), or auto",
    "setup": "shell lines run before the launcher, in the workdir (a venv, modules)",
    "container": "run the node's part in a container image (podman, docker, apptainer, enroot)",
    "host": "the node's name or address, as `ssh HOST` takes it",
    "addr": "the address the other nodes use for it (default: what ssh resolves)",
    "user": "the ssh login", "port": "the ssh port", "identity_file": "the ssh key",
    "known_hosts": "the known_hosts file checked", "connect_timeout": "seconds to connect",
    "config_file": "an ssh config file", "client": "openssh (your ssh) or fabric (paramiko)",
    "max_parallel": "ssh connections opened at once",
}


# An example of each key, as it is written in a cluster file (the reference shows these; the
# schema gives them to an editor; a test loads each through the validator).
EXAMPLE = {
    "nodes": "[{host: gpu-a, gpus: 8}, {host: gpu-b, gpus: 8}]", "ssh": "{user: me, identity_file: ~/.ssh/id_ed25519}",
    "master": "{addr: 10.0.0.1, port: 29500}", "orphan_timeout": "30", "stop_grace": "2m", "stop_signal": "SIGUSR1",
    "hang_timeout": "10m", "startup_timeout": "20m", "launcher": "accelerate", "env_file": ".env",
    "forward_env": "[WANDB_*, HF_TOKEN]", "secrets": "[MY_API_KEY]", "sync": "{src: ., exclude: [data/]}",
    "retention": "3d", "restarts": "3", "restart_delay": "30s", "no_restart_on_exit": "[2]", "recoveries": "5",
    "spares": "1", "min_nodes": "3", "rejoin_after": "30m", "evict_after": "15m", "nodes_command": "./list-nodes.sh", "flight_recorder": "false", "report": "false", "notify": "[ntfy://my-topic]", "warm": "true",
    "preload": "[lightning, transformers]", "measure_gpus": "true",
    "metrics": "[{name: val_acc, pattern: 'val acc (?P<value>[0-9.]{1,20})'}]",
    "fetch": "[ckpt, logs/metrics.json]", "python": "~/venv/bin/python", "workdir": "~/project",
    "env": "{NCCL_DEBUG: WARN}", "transport": "srun", "gpus": "auto", "setup": "module load cuda/12.4",
    "container": "{image: nvcr.io/nvidia/pytorch:24.05-py3}", "host": "gpu-a", "addr": "10.0.0.2", "user": "me",
    "port": "2222", "identity_file": "~/.ssh/id_ed25519", "known_hosts": "~/.ssh/known_hosts",
    "connect_timeout": "20", "config_file": "~/.ssh/config", "client": "fabric", "max_parallel": "32",
}


def rule_schema(rule: Rule) -> dict[str, Any]:
    """A Checks rule's value as JSON Schema, or null: a key left empty takes its default (Checks.apply)."""
    return or_null(shape(rule))


def or_null(value: dict[str, Any]) -> dict[str, Any]:
    """``value``, or a key left empty (null): it takes its default (Checks.apply)."""
    return {"anyOf": [value, {"type": "null"}]}


def shape(rule: Rule) -> dict[str, Any]:
    """A Checks rule's value as JSON Schema (validate.Checks: the method of that name)."""
    args = dict(rule.args)
    if rule.check == "positive":
        return duration(args.get("allow_zero", False), args.get("most", LONGEST))
    if rule.check == "duration":
        return duration(True, LONGEST_RETENTION)
    if rule.check == "positive_or_never":
        return {"anyOf": [duration(args.get("allow_zero", False), LONGEST), {"const": "never"}]}
    if rule.check == "integer":
        out = {"type": "integer", "minimum": args.get("low", 0)}
        if args.get("high"):
            out["maximum"] = args["high"]
        return out
    if rule.check == "choice":
        return {"enum": list(args["allowed"])}
    if rule.check == "boolean":
        return {"type": "boolean"}
    if rule.check == "signal_name":
        return {"type": "string", "pattern": signal_pattern(), "examples": list(JOB_SIGNALS)}
    if rule.check == "exit_codes":
        return {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 255}}
    if rule.check == "fetch_paths":  # ownfiles.fetch_name: a path whose copy has a name of its own
        path = {"type": "string", "allOf": [LINE, {"pattern": FETCH_PATH}]}
        return {"anyOf": [path, {"type": "array", "items": path}]}
    if rule.check == "module_names":
        module = {"type": "string", "pattern": f"^{MODULE_NAME.pattern}$"}
        return {"anyOf": [module, {"type": "array", "items": module}]}
    return dict(STRING)  # string, file_path, existing_file


def shared() -> dict[str, Any]:
    return {"python": dict(STRING), "workdir": or_null(STRING), "env": dict(ENV),
            "transport": {"enum": list(TRANSPORTS)},
            "gpus": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": MOST_PROCS}, {"const": "auto"}]},
            "setup": dict(STRINGS),
            "container": container_shape()}


def container_shape() -> dict[str, Any]:
    """containers.container: an image's name, or a mapping of KEYS (whose runtime's options ddp-up
    keeps for itself, and pyxis under srun alone, the validator checks)."""
    text = {"type": "string", "pattern": r"^\S(.*\S)?$"}  # not empty, no surrounding blanks
    image = {"type": "string", "pattern": r"^[^\s-](.*\S)?$"}  # ... and not an option
    mount = {"type": "string", "pattern": f"^/[^:,]*(:/[^:,]*(:({'|'.join(MOUNT_OPTIONS)}))?)?$"}
    mapping = {"type": "object", "required": ["image"], "additionalProperties": False,
               "properties": {"image": image, "python": text, "runtime": {"enum": list(RUNTIMES)},
                              "pull": {"enum": list(PULLS)}, "mounts": {"type": "array", "items": mount},
                              "options": {"type": "array", "items": {"type": "string", "minLength": 1}}}}
    return {"anyOf": [image, mapping, {"type": "null"}]}


def notify_shape() -> dict[str, Any]:
    """notify.targets: Apprise URLs (whose services Apprise alone knows), or one of url, webhook,
    command each, with the events it is sent."""
    line = {"type": "string", "pattern": r"\S"}
    kinds = {"url": line, "webhook": {"type": "string", "pattern": "^https?://"}, "command": line}
    target = {"type": "object", "additionalProperties": False, "minProperties": 1,
              "properties": {**kinds, "on": {"type": "array", "minItems": 1, "items": {"enum": list(EVENTS)}}},
              "oneOf": [{"required": [kind]} for kind in kinds]}
    return {"anyOf": [{"type": "array", "items": {"anyOf": [line, target]}}, {"type": "null"}]}


def described(props: dict[str, Any]) -> dict[str, Any]:
    """Each property with its meaning and, for an editor's completion, its example's value."""
    return {key: dict(value, description=value.get("description") or MEANING.get(key, ""),
                      **({"examples": [yaml.safe_load(f"{key}: {EXAMPLE[key]}")[key]]} if key in EXAMPLE else {}))
            for key, value in props.items()}


def obj(props: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    out = {"type": "object", "properties": described(props), "additionalProperties": False}
    if required:
        out["required"] = list(required)
    return out


def cluster_schema() -> dict[str, Any]:
    ssh = {key: rule_schema(rule) for key, rule in SSH_RULES.items()}
    node = {"host": dict(HOST), "addr": dict(STRING), **shared(), **ssh}
    top = {
        "nodes": {"type": "array", "minItems": 1, "items": obj({k: node[k] for k in NODE_KEYS if k in node}, ("host",))},
        "ssh": obj(ssh),
        "master": obj({"addr": dict(STRING, description="the address every node reaches the master at"),
                       "port": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 65535}, {"const": "auto"}],
                                "description": "the rendezvous port, or auto (a free one below the ephemeral range, each "
                                               "attempt)"}}),
        "env_file": or_null(STRING), "forward_env": dict(NAMES), "secrets": dict(NAMES),
        "sync": {"anyOf": [{"type": "string", "minLength": 1}, {"const": False}, {"type": "null"},
                           obj({"src": dict(STRING), "exclude": dict(STRINGS), "gitignore": {"type": "boolean"}},
                               ("src",))]},
        "min_nodes": or_null({"type": "integer", "minimum": 1}),
        "nodes_command": or_null({"type": "string", "pattern": r"\S"}),
        "notify": notify_shape(),
        "metrics": {"anyOf": [{"type": "boolean"}, {"type": "null"}, {"type": "array", "items": {"anyOf": [
            {"type": "string", "minLength": 1, "maxLength": 500},
            obj({"name": {"type": "string", "maxLength": 64, "pattern": r"^[A-Za-z0-9_./-]([A-Za-z0-9_. /-]*[A-Za-z0-9_./-])?$"},
                 "pattern": {"type": "string", "minLength": 1, "maxLength": 500}}, ("pattern",))]}}]},
        **{key: rule_schema(rule) for key, rule in RULES.items()},
        **shared(),
    }
    # the nodes are listed, or a program lists them: one of the two
    command = {"required": ["nodes_command"], "properties": {"nodes_command": {"type": "string"}}}
    return {"$schema": SCHEMA_URL, "title": "ddp-up cluster file", **obj({k: top[k] for k in TOP_KEYS if k in top}),
            "if": command, "then": {"not": {"required": ["nodes"]}}, "else": {"required": ["nodes"]}}


def schema_text() -> str:
    return json.dumps(cluster_schema(), indent=2) + "\n"
