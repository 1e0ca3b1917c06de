"""The manual's reference pages, written from the code so that they cannot drift from it: the
cluster file's keys (the validator's tables, through schema.py), every command's options (its own
parser), every exit status (commands/common.EXITS) and the environment every rank gets.

    python3 -m orchestrator.commands.reference docs/reference

A test regenerates them and fails where the committed pages differ.
"""

from __future__ import annotations

import json
import os
import sys

from ..config.schema import EXAMPLE, MEANING, cluster_schema
from ..config.validate import NODE_KEYS, RULES, SHARED_KEYS, SSH_RULES, TOP_KEYS

# What ddp-up (not torchrun) sets in every rank's environment, and why. A test runs a job and
# compares: a variable set and not listed here, or listed and never set, fails it.
RANK_ENVIRONMENT = {
    "DDP_UP_JOB": "the job id (every process ddp-up starts carries it: ddp-kill finds them by it)",
    "DDP_UP_NODE": "the node's index in the cluster file",
    "DDP_UP_CLUSTER": "the id of the cluster file the job was launched from",
    "DDP_UP_RUN": "one launch (an attempt), so a cleanup never touches another",
    "DDP_UP_ATTEMPT": "0 for the first run, then 1, 2... after each restart: resume from a checkpoint when > 0",
    "DDP_UP_FLIGHT_DIR": "where the ranks' Flight Recorder records go (private to the job)",
    "DDP_UP_FLIGHT_EVERY": "how often a rank writes its Flight Recorder record, in seconds",
    "DDP_UP_RANK_PID": "set by ddp-up's hook in the rank's own process, so its children (a DataLoader's workers) are "
                       "not taken for the rank when it tells that its script ended",
    "TORCH_FR_BUFFER_SIZE": "the Flight Recorder on (torch 2.9 and later; the older name before)",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "NCCL writes its Flight Recorder record on a collective timeout",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "where that record goes (the job's private directory)",
    "TORCH_FR_DUMP_TEMP_FILE": "the same, under torch's newer name",
    "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "torchrun's wait between its stop signal and SIGKILL: stop_grace",
    "TORCHELASTIC_ERROR_FILE": "where a rank's `@record` writes its exception (`launcher: none`; torchrun sets its own)",
    "PET_LOG_DIR": "torchrun's per-rank log files, kept out of your workdir (the agent relays them)",
    "PYTHONPATH": "ddp-up's hooks first (stack dumps on a hang, the Flight Recorder), then yours",
    "TTY_COMPATIBLE": "Rich draws its progress bars as on a terminal (its file is not one)",
    "TTY_INTERACTIVE": "the same, for Rich's live display",
    "COLUMNS": "200, a wide terminal's width, for what fills it (a Rich Panel, argparse's help); while Rich's bar is live, the rank's own lines still go whole",
    "GLOO_SOCKET_IFNAME": "the interface that reaches the master, where you did not set it",
    "NCCL_SOCKET_IFNAME": "the same for NCCL",
}


def cluster_file_page() -> str:
    schema = cluster_schema()
    props = schema["properties"]
    node_props = props["nodes"]["items"]["properties"]
    out = ["# Cluster file reference", "",
           "Every key the cluster file takes (`ddp-up --schema` prints the same as JSON Schema). Durations take a "
           "number of seconds or a unit (`90`, `90s`, `5m`, `12h`, `7d`).", "",
           "## Top level", "", "| key | type | default | meaning | example |", "|---|---|---|---|---|"]
    for key in TOP_KEYS:
        where = " (also per node)" if key in SHARED_KEYS else ""
        out.append(f"| `{key}`{where} | {kind(props[key])} | {default(key)} | {MEANING.get(key, '')} | {example(key)} |")
    out += ["", "## On a node", "", "Each entry of `nodes:`; a key set here wins over the top level's.", "",
            "| key | type | meaning | example |", "|---|---|---|---|"]
    for key in NODE_KEYS:
        out.append(f"| `{key}` | {kind(node_props[key])} | {MEANING.get(key, '')} | {example(key)} |")
    out += ["", "## `ssh:`", "", "| key | type | default | meaning | example |", "|---|---|---|---|---|"]
    for key, rule in SSH_RULES.items():
        shown = "-" if rule.default is None or callable(rule.default) else f"`{json.dumps(rule.default)}`"
        out.append(f"| `{key}` | {kind(props['ssh']['properties'][key])} | {shown} | {MEANING.get(key, '')} | "
                   f"{example(key)} |")
    return "\n".join(out) + "\n"


def kind(prop: dict) -> str:
    """A schema property, in words: `integer 1-1024`, `one of a, b`, `string or list of strings`."""
    if "enum" in prop:
        return "one of " + ", ".join(f"`{v}`" for v in prop["enum"])
    if "const" in prop:
        const = prop["const"]
        return f"`{const if isinstance(const, str) else json.dumps(const)}`"
    if prop.get("description", "").startswith("seconds, or with a unit"):
        return "duration"
    if "anyOf" in prop:  # null, a key left empty, takes the default the table shows
        words = [kind(p) for p in prop["anyOf"] if p.get("type") != "null"]
        return " or ".join(dict.fromkeys(words))
    t = prop.get("type", "any")
    t = t[0] if isinstance(t, list) else t  # text that may be written as a number: text
    if t == "integer" and "minimum" in prop:
        return f"integer {prop['minimum']}" + (f"-{prop['maximum']}" if "maximum" in prop else "+")
    if t == "array":
        return f"list of {kind(prop.get('items', {}))}s"
    return "mapping" if t == "object" else str(t)


def example(key: str) -> str:
    return f"`{key}: {EXAMPLE[key]}`" if key in EXAMPLE else ""


def default(key: str) -> str:
    rule = RULES.get(key)
    if rule is None or rule.default is None or callable(rule.default) or rule.default == ():
        return "-"
    return f"`{json.dumps(rule.default)}`"


def parsers() -> list:
    from .attach import attach_parser, logs_parser, ls_parser
    from .check import check_parser
    from .fetch import fetch_parser
    from .kill import kill_parser
    from .report import report_parser
    from .up import up_parser

    return [up_parser(), check_parser(), kill_parser(), ls_parser(), attach_parser(), logs_parser(), fetch_parser(),
            report_parser()]


def commands_page() -> str:
    out = ["# Commands", "", "Each command's `--help`, as it prints it (at 100 columns)."]
    width = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal's width: the page is the same anywhere
    try:
        for parser in parsers():
            out += ["", f"## {parser.prog}", "", "```", parser.format_help().rstrip(), "```"]
    finally:
        os.environ.pop("COLUMNS") if width is None else os.environ.__setitem__("COLUMNS", width)
    return "\n".join(out) + "\n"


def exits_page() -> str:
    from .common import EXITS

    out = ["# Exit statuses", "", "| command | exit statuses |", "|---|---|"]
    out += [f"| `{prog}` | {text} |" for prog, text in EXITS.items()]
    return "\n".join(out) + "\n"


def environment_page() -> str:
    out = ["# A rank's environment", "",
           "What ddp-up sets in every rank's environment, besides what the launcher sets (torchrun: `RANK`, "
           "`LOCAL_RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`...) and the job's own `env:`, which wins.", "",
           "| variable | why |", "|---|---|"]
    out += [f"| `{name}` | {why} |" for name, why in RANK_ENVIRONMENT.items()]
    return "\n".join(out) + "\n"


PAGES = {"cluster-file.md": cluster_file_page, "commands.md": commands_page, "exit-status.md": exits_page,
         "environment.md": environment_page}


def main(argv: list[str]) -> int:
    where = argv[0] if argv else os.path.join("docs", "reference")
    os.makedirs(where, exist_ok=True)
    for name, make in PAGES.items():
        with open(os.path.join(where, name), "w") as f:
            f.write(make())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
