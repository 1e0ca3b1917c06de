"""The notebook example (examples/notebook.ipynb), run cell by cell by a real Jupyter kernel
(nbclient) against the sshd cluster: a function launched on every rank, each rank's return value
back, a checkpoint fetched from every node, and a rank's exception raised in the notebook. The
cluster file keeps a user's defaults (torchrun, warm): the second launch forks from the interpreters
the first one made (test_warm_start checks that part), and the leak check finds them gone once the
kernel has shut down."""

from __future__ import annotations

import ast
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "notebook.ipynb"


def value(cell) -> object:
    """A cell's result, as its text shows it (the notebook's values are plain literals)."""
    shown = next(o for o in cell.outputs if o.output_type == "execute_result")
    return ast.literal_eval(shown.data["text/plain"])


def test_the_notebook_launches_a_function_brings_results_and_files_back(cluster, cluster_file, tmp_path, monkeypatch):
    path = cluster_file([(0, 2), (1, 1)])
    monkeypatch.setenv("DDP_UP_CLUSTER", str(path))  # the kernel's environment: the notebook reads it
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    cells = [c for c in nb.cells if c.cell_type == "code"]
    results = value(cells[2])
    assert sorted(results) == [0, 1, 2] and {r["rank"] for r in results.values()} == {0, 1, 2}
    assert all(r["world"] == 3 and isinstance(r["loss"], float) for r in results.values()), results
    first, second = cluster.nodes[0].addr, cluster.nodes[1].addr
    assert value(cells[3]) == [(first, 1), (second, 1)]  # the checkpoint, from each node's workdir
    assert (tmp_path / "fetched" / first / "outputs" / "model.pt").stat().st_size > 0
    said = "".join(o.get("text", "") for o in cells[4].outputs if o.output_type == "stream")
    assert f"rank 1 on {first} (node 0): FloatingPointError: loss is nan at step 3" in said, said
    assert said.rstrip().endswith("FloatingPointError")
