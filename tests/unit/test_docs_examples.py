"""Every YAML example in the README and the docs loads through the validator, as a user would
paste it: a fragment goes into a minimal cluster file, alternatives shown one after the other
(several `container:` lines) are loaded one by one, and the files an example names exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from orchestrator.config.clusterfile import parse_cluster

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def examples() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for m in re.finditer(r"```ya?ml\n(.*?)```", text, re.S):
            found.append((f"{doc.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}", m.group(1)))
    return found


def alternatives(block: str) -> list[str]:
    """The block, or its paragraphs where it shows one key's alternatives (the same top-level key twice)."""
    keys = re.findall(r"^(\w+):", block, re.M)
    return [p for p in block.split("\n\n") if p.strip()] if len(keys) != len(set(keys)) else [block]


@pytest.mark.parametrize("where, block", examples(), ids=[w for w, _ in examples()])
def test_every_yaml_example_is_a_valid_cluster_file(where, block, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".ssh").mkdir()
    (tmp_path / ".ssh" / "config").write_text("")
    for name in re.findall(r"env_file:\s*(\S+)", block):
        (tmp_path / name).write_text("")
    for text in alternatives(block):
        if not isinstance(yaml.safe_load(text), dict):
            continue  # not a cluster file's mapping (a list of hosts, say)
        for name in re.findall(r"^nodes_command:\s*(\S+)", text, re.M):  # its program, printing three hosts
            (tmp_path / name).write_text("#!/bin/sh\necho a slots=1\necho b slots=1\necho c slots=1\n")
            (tmp_path / name).chmod(0o755)
        if not re.search(r"^nodes(_command)?:", text, re.M):
            text = "nodes: [{host: a, gpus: 1}]\n" + text
        if "runtime: pyxis" in text:
            text = "transport: srun\n" + text  # pyxis is Slurm's
        path = tmp_path / "cluster.yaml"
        path.write_text(text)
        parse_cluster(text, str(path))  # raises ConfigError, naming the line, where the example is wrong
