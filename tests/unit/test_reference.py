"""The reference pages are the code's own word: regenerated here, they must equal what is committed;
and the environment page names every variable ddp-up sets in a rank, as a real job sees it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from orchestrator.commands import reference

REPO = Path(__file__).resolve().parents[2]
LAUNCHER_VARS = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
                 "NODE_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "GROUP_WORLD_SIZE"}


def test_the_committed_reference_is_what_the_code_says():
    for name, make in reference.PAGES.items():
        committed = (REPO / "docs" / "reference" / name).read_text()
        assert committed == make(), f"docs/reference/{name} is stale: run `python3 -m orchestrator.commands.reference`"


def test_every_variable_ddp_up_sets_in_a_rank_is_in_the_reference(tmp_path):
    from tests.harness.runner import _env, ddp_up

    script = tmp_path / "env.py"
    script.write_text("import json, os, sys\njson.dump(dict(os.environ), open(sys.argv[1] + os.environ['RANK'], 'w'))\n")
    cluster = tmp_path / "c.yaml"
    cluster.write_text(f"transport: local\npython: {sys.executable}\nworkdir: {tmp_path}\nlauncher: none\n"
                       "env: {OMP_NUM_THREADS: 1}\nnodes: [{host: a, gpus: 1}]\n")
    code, out, _ = ddp_up("--no-dashboard", str(cluster), str(script), str(tmp_path / "env."))
    assert code == 0, out
    seen = json.loads((tmp_path / "env.0").read_text())
    controller = _env()  # what the test's ddp-up runs with
    added = {k for k in seen if k not in controller or k == "PYTHONPATH"} - {"OMP_NUM_THREADS"} - LAUNCHER_VARS
    assert added - set(reference.RANK_ENVIRONMENT) == set(), "set in a rank, not in docs/reference/environment.md"
    always = {"DDP_UP_JOB", "DDP_UP_NODE", "DDP_UP_CLUSTER", "DDP_UP_RUN", "DDP_UP_ATTEMPT", "PYTHONPATH",
              "TTY_COMPATIBLE", "TTY_INTERACTIVE"}
    assert always <= added, always - added
