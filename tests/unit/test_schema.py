"""The cluster file's JSON Schema: written from the validator's tables, shipped, and true to every
example the README and the docs show."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from orchestrator.config.schema import MEANING, cluster_schema, schema_text
from orchestrator.config.validate import NODE_KEYS, SSH_RULES, TOP_KEYS

REPO = Path(__file__).resolve().parents[2]


def test_the_schema_names_every_key_the_validator_takes_and_no_other():
    schema = cluster_schema()
    assert list(schema["properties"]) == list(TOP_KEYS)
    assert set(schema["properties"]["nodes"]["items"]["properties"]) == set(NODE_KEYS)
    assert set(schema["properties"]["ssh"]["properties"]) == set(SSH_RULES)
    assert not schema["additionalProperties"] and schema["else"] == {"required": ["nodes"]}  # or nodes_command
    keys = set(TOP_KEYS) | set(NODE_KEYS)
    assert keys <= set(MEANING), keys - set(MEANING)  # every key says what it is


def test_the_package_ships_the_schema_ddp_up_prints(capsys):
    from orchestrator.commands.up import main_up

    shipped = (REPO / "orchestrator" / "cluster.schema.json").read_text()
    assert shipped == schema_text(), "stale: run `ddp-up --schema > orchestrator/cluster.schema.json`"
    with pytest.raises(SystemExit) as ended:
        main_up(["--schema"])
    assert ended.value.code == 0 and capsys.readouterr().out == shipped


def examples() -> list[tuple[str, str]]:
    found = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        for block in re.findall(r"```yaml\n(.*?)```", path.read_text(), re.S):
            if re.search(r"^nodes:", block, re.M):
                found.append((path.name, block))
    return found + [(p.name, p.read_text()) for p in sorted((REPO / "configs").glob("*.yaml"))]


@pytest.mark.parametrize("where,text", examples())
def test_every_example_cluster_file_passes_the_schema(where, text):
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(yaml.safe_load(text), cluster_schema())


def test_the_schema_refuses_what_the_validator_refuses():
    jsonschema = pytest.importorskip("jsonschema")
    for bad in ({"nodes": [{"host": "a", "gpus": 0}]}, {"nodes": [{"host": "a", "gpuz": 1}]},
                {"nodes": [{"host": "a"}], "launcher": "mpirun"}, {"nodes": []}, {"node": [{"host": "a"}]},
                {"nodes": [{"host": "a"}], "restarts": -1}, {"nodes": [{"host": "a"}], "hang_timeout": "soon"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, cluster_schema())


def test_every_key_has_an_example_that_the_schema_takes():
    jsonschema = pytest.importorskip("jsonschema")
    from orchestrator.config.schema import EXAMPLE

    schema = cluster_schema()
    node = schema["properties"]["nodes"]["items"]["properties"]
    ssh = schema["properties"]["ssh"]["properties"]
    for key in set(TOP_KEYS) | set(NODE_KEYS):
        assert key in EXAMPLE, key
        value = yaml.safe_load(f"{key}: {EXAMPLE[key]}")[key]
        prop = schema["properties"].get(key) or node.get(key) or ssh.get(key)
        jsonschema.validate(value, prop)


def test_every_keys_example_is_a_valid_cluster_file_as_the_validator_reads_it(tmp_path, monkeypatch):
    from orchestrator.config.clusterfile import parse_cluster
    from orchestrator.config.schema import EXAMPLE
    from orchestrator.config.validate import SSH_RULES

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".ssh").mkdir()
    (tmp_path / ".ssh" / "config").write_text("")
    (tmp_path / ".env").write_text("A=1\n")
    monkeypatch.chdir(tmp_path)
    nodes = "nodes: [{host: a, gpus: 1}, {host: b, gpus: 1}, {host: c, gpus: 1}, {host: d, gpus: 1}]\n"
    for key, example in EXAMPLE.items():
        if key in SSH_RULES:
            text = f"{nodes}ssh: {{{key}: {example}}}\n"
        elif key in ("host", "addr"):
            text = f"nodes: [{{host: x, gpus: 1, {key}: {example}}}]\n".replace("host: x, gpus: 1, host:", "gpus: 1, host:")
        elif key == "nodes":
            text = f"nodes: {example}\n"
        elif key == "nodes_command":  # its program, in the cluster file's folder
            (tmp_path / "list-nodes.sh").write_text("#!/bin/sh\necho a slots=1\n")
            (tmp_path / "list-nodes.sh").chmod(0o755)
            text = f"{key}: {example}\n"
        elif key == "evict_after":  # with a node to spare
            text = f"{nodes}spares: 1\n{key}: {example}\n"
        else:
            text = f"{nodes}{key}: {example}\n"
        parse_cluster(text, str(tmp_path / "c.yaml"))  # raises ConfigError, naming the key, if it is not
