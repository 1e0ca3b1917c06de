"""The JSON Schema and the validator, over a table of values per key, in both directions: a value
the schema takes, the validator takes, and one it refuses, the validator refuses; each constraint
is written from the same rule (schema.py, validate.py, values.py). What a schema cannot say is
listed once, with why (VALIDATOR_ALONE), and the table shows it is so."""

from __future__ import annotations

import math

import pytest
import yaml

from orchestrator.config.clusterfile import parse_cluster
from orchestrator.config.schema import cluster_schema
from orchestrator.errors import ConfigError

jsonschema = pytest.importorskip("jsonschema")

DURATIONS = [0, 5, 2.5, "90s", "5m", " 12h ", "7d", "1.5H", -1, math.inf, -math.inf, math.nan, 10**10, "1e-300", "1e3", "",
             "soon", "5 minutes", "inf", True, None, [5]]
COUNTS = [0, 1, 2, 2.0, 2.5, -1, 10**9, True, "2", None, math.inf, math.nan]
TEXTS = ["a", "", " ", 5, 1.5, True, None, [], {}]
TABLE: dict[str, list] = {
    "orphan_timeout": DURATIONS, "stop_grace": DURATIONS, "hang_timeout": DURATIONS, "restart_delay": DURATIONS,
    "startup_timeout": DURATIONS, "retention": DURATIONS,
    "restarts": COUNTS, "recoveries": COUNTS, "spares": [0, 1, 1.0, -1, 0.5, True],
    "stop_signal": ["SIGTERM", "usr1", "SigUsr2", "INT", "SIGKILL", "KILL", "sigterm ", "ſigusr1", "", 15, None],
    "launcher": ["torchrun", "none", "accelerate", "legacy", "mpirun", "", 1],
    "no_restart_on_exit": [[2], [2, 3.0], [], [0], [256], [2.5], [True], "2", 2],
    "flight_recorder": [True, False, "yes", 1, None], "report": [True, False, "yes", 1, None], "warm": [True, False, "yes", 1, None],
    "preload": [["lightning"], ["torch.nn", "transformers"], [], "lightning", [""], ["a-b"], ["1x"], ["a..b"], [1],
                ["os; rm"], 5],
    "fetch": ["ckpt", ["ckpt", "logs/m.json"], [], "", " ", [""], ["a", 1], 5, "/", "..", "ckpt/..", "~",
              ["a/ckpt", "b/ckpt"], [".."], ["ckpt", "~user"], "a/b/..", "a/.", "//", "~/", "../shared/ckpt",
              "a/../b", "...", "a..b", ["~/ckpt"], " .. "],
    "forward_env": [["WANDB_*"], [], [""], "WANDB_*", [1]],
    "secrets": [["MY_KEY"], [""], "X"],
    "env": [{"A": "1"}, {"A": 1}, {"A": True}, {"A": 1.5}, {"": "x"}, {"A=B": "x"}, {"1A": "x"}, {"A": None},
            {"A": [1]}, {"A": {"b": 1}}, "A=1", []],
    "workdir": TEXTS, "python": TEXTS, "env_file": TEXTS, "setup": ["ls", ["a", "b"], "", " ", [""], [1], 5],
    "transport": ["ssh", "local", "srun", "rsh", ""],
    "gpus": [1, 8, 1024, 1025, 0, -1, 1.0, 1.5, "auto", "AUTO", "8", True, None],
    "host": ["gpu-a", "10.0.0.1", "user@h", "", " ", "a b", "-oProxyCommand=x", "a\tb", "a\x01", 7, True, None],
    "addr": TEXTS, "user": TEXTS, "identity_file": TEXTS, "known_hosts": TEXTS,
    "port": [22, 1, 65535, 0, 65536, 22.0, 22.5, "22", True],
    "connect_timeout": DURATIONS, "max_parallel": [1, 10, 1024, 0, 1025, 10.0, "10"],
    "client": ["openssh", "fabric", "paramiko", ""],
    "master": [{"addr": "10.0.0.1"}, {"addr": ""}, {"port": 29500}, {"port": "auto"}, {"port": 0}, {"port": 70000},
               {"port": 29500.0}, {"addr": "h", "port": "x"}, {"other": 1}, {}, "x"],
    "measure_gpus": [True, False, "yes", 1, None],
    "metrics": [True, False, None, [], ["(?P<name>a{1,9})=(?P<value>[0-9]{1,9})"], ["(a+)+(?P<value>x)"],
                ["loss (?P<value>1)"], [{"name": "bleu", "pattern": "B (?P<value>[0-9]{1,9})"}],
                [{"name": "<b>", "pattern": "(?P<value>1)"}], [{"name": "a ", "pattern": "(?P<value>1)"}],
                [{"pattern": 5}], [{"name": "x"}], [{"pattern": "(?P<name>x)(?P<value>1)", "other": 1}], [5], [""],
                "x", 5, {}],
    "min_nodes": [1, 2, 3, 0, -1, 1.5, "2", True, None, math.nan],
    "rejoin_after": [*DURATIONS, "never", "Never", "never ", "nevermore"],
    "evict_after": DURATIONS,
    "nodes_command": ["echo a slots=1", "", 5, True, None],  # beside `nodes:`: refused, but when empty
    "config_file": ["/dev/null", "", 5, None, "/nonexistent/ssh_config"],
    "notify": [["ntfy://topic"], [], [{"webhook": "https://example.invalid/hook"}], [{"webhook": "ftp://x"}],
               [{"command": "logger x", "on": ["ended"]}], [{"command": "x", "on": []}], [{"command": "x", "on": ["x"]}],
               [{"url": "https://example.invalid/hook"}], [{"url": "a", "command": "b"}], [{}], [{"command": " "}],
               "ntfy://topic", [5], 5, {}],
    "container": [{"image": "img"}, {"image": ""}, {}, "img", {"image": "img", "runtime": "podman"},
                  {"image": "img", "runtime": "rkt"}, {"image": "--privileged"}, {"image": "img", "other": 1}, 5,
                  " img", {"image": "img", "mounts": ["/d:/d:ro"]}, {"image": "img", "mounts": ["d:/d"]},
                  {"image": "img", "mounts": ["/d:/d:rx"]}, {"image": "img", "pull": "always"},
                  {"image": "img", "pull": "sometimes"}, {"image": "img", "python": ""}, None],
    "nodes": [[{"host": "a", "gpus": 1}], [], "a", [{"gpus": 1}], [{"host": "a", "gpus": 1, "extra": 1}], 5],
    "ssh": [{"user": "u"}, {}, {"other": 1}, "u", 5],
    "sync": ["src", {"src": "src"}, {"src": ""}, "", {"src": "s", "exclude": ["data/"]}, {"src": "s", "exclude": [""]},
             {"src": "s", "gitignore": "no"}, {"exclude": ["x"]}, False, None, 5],
}
NODE_KEYS = {"host", "addr", "gpus", "transport"}
SSH_KEYS = {"user", "port", "identity_file", "known_hosts", "connect_timeout", "max_parallel", "client"}

# What the schema cannot say, and the validator checks alone: repr((key, value)) -> why.
VALIDATOR_ALONE = {
    # two paths whose copies share a name: no schema keyword compares items' last parts
    repr(("fetch", ["a/ckpt", "b/ckpt"])): "two copies of one name",
    # more nodes to keep than the job starts on: no schema keyword compares a value with a count
    repr(("min_nodes", 3)): "compared with the nodes",
    # the services Apprise knows: its own list, which no pattern holds
    repr(("notify", [{"url": "https://example.invalid/hook"}])): "Apprise's services",
    # a regular expression's shape (its time on a hostile line) and its groups: no schema keyword reads a pattern
    repr(("metrics", ["(a+)+(?P<value>x)"])): "a pattern's shape",
    repr(("metrics", ["loss (?P<value>1)"])): "a pattern's groups",
}


def cluster_with(key: str, value) -> dict:
    nodes = [{"host": "a", "gpus": 1}, {"host": "b", "gpus": 1}]  # two: `spares: 1` leaves one to start on
    if key in NODE_KEYS:
        return {"nodes": [{**nodes[0], key: value}, nodes[1]]}
    if key in SSH_KEYS:
        return {"nodes": nodes, "ssh": {key: value}}
    if key == "evict_after":  # a slow node set aside needs a spare (or min_nodes) to do without it
        return {"nodes": nodes, "spares": 1, key: value}
    return {"nodes": nodes, key: value}


def validator_takes(data: dict) -> bool:
    try:
        parse_cluster(yaml.safe_dump(data), "c.yaml", local_files=False)
    except ConfigError:
        return False
    return True


CHECKER = jsonschema.Draft202012Validator(cluster_schema())


def schema_takes(data: dict) -> bool:
    try:
        CHECKER.validate(data)
    except jsonschema.ValidationError:
        return False
    return True


CASES = [(key, value) for key, values in TABLE.items() for value in values]


@pytest.mark.parametrize("key,value", CASES, ids=[f"{k}={v!r}" for k, v in CASES])
def test_the_schema_and_the_validator_agree(key, value):
    data = cluster_with(key, value)
    validator, schema = validator_takes(data), schema_takes(data)
    if repr((key, value)) in VALIDATOR_ALONE:
        assert schema and not validator, "listed as the validator's alone, but they agree: drop it from the list"
    else:
        assert schema == validator, f"{key}: {value!r}: the schema {'takes' if schema else 'refuses'} it, the " \
                                    f"validator {'takes' if validator else 'refuses'} it"


def test_the_table_holds_values_each_side_takes_and_refuses():
    verdicts = {validator_takes(cluster_with(k, v)) for k, v in CASES}
    assert verdicts == {True, False} and len(CASES) >= 250


def test_the_table_holds_every_key_of_the_validator_with_values_it_refuses():
    """Every key, top-level, a node's or ssh's, has its refusals in the table: a refusal that only
    one side makes is found here, not by a user whose editor took what ddp-up refuses."""
    from orchestrator.config.validate import NODE_KEYS as NODE, SSH_RULES, TOP_KEYS

    keys = set(TOP_KEYS) | set(NODE) | set(SSH_RULES)
    assert keys <= set(TABLE), sorted(keys - set(TABLE))
    refuses = {key for key, value in CASES if not validator_takes(cluster_with(key, value))}
    assert keys <= refuses, sorted(keys - refuses)
