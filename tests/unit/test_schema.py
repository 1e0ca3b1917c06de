"""The cluster file's JSON Schema: written from the validator's tables, shipped, and true to every
example the README and the docs show."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from orchestrator.schema import MEANING, cluster_schema, schema_text
from orchestrator.validate import NODE_KEYS, SSH_RULES, TOP_KEYS

REPO = Path(__file__).resolve().parents[2]


def test_the_schema_names_every_key_the_validator_takes_and_no_other():
    schema = cluster_schema()
    assert list(schema["properties"]) == list(TOP_KEYS)
    assert set(schema["properties"]["nodes"]["items"]["properties"]) == set(NODE_KEYS)
    assert set(schema["properties"]["ssh"]["properties"]) == set(SSH_RULES)
    assert not schema["additionalProperties"] and schema["required"] == ["nodes"]
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
