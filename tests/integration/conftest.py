"""Fixtures: one real 4-node SSH cluster per session, and a leak check after every test."""

from __future__ import annotations

import importlib.util
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import procs
from tests.harness.sshcluster import SSHCluster, available

SCRIPT = str(Path(__file__).resolve().parents[1] / "scripts" / "job.py")


def needs(module: str) -> None:
    """Skip the test unless ``module`` is installed, found without importing it: the ranks import
    it, not the test's own process (Lightning's import alone is 5 s of CPU, paid once a worker)."""
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"needs {module} (pip install -e '.[test]')")


def pytest_collection_modifyitems(items):
    reason = available()
    for item in items:
        if "integration" in str(item.fspath):
            item.add_marker(pytest.mark.integration)
            if reason:
                item.add_marker(pytest.mark.skip(reason=f"integration: {reason}"))


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    c = SSHCluster(4, tmp_path_factory.mktemp("sshcluster"))
    try:
        yield c.up()
    finally:
        c.down()


@pytest.fixture(scope="session", autouse=True)
def no_ssh_runs_left():
    """Tests that SIGKILL ddp-up leave its ssh masters and run directory behind by design (they
    time out, and the next ddp-up removes the directory): the session ends them, leaving nothing."""
    yield
    procs.end_orphaned_ssh_runs()


@pytest.fixture
def cluster_file(cluster, tmp_path, request):
    """Write a cluster file for [(node index 0-based, gpus), ...] with test-friendly defaults. A
    module whose subject is not the launcher says `LAUNCHER = "none"`: its torch-free workloads
    (job.py tick, save, env) then start without importing torch, which costs 1.5-3 s of CPU a
    process on a 2-core machine (the suite's largest single cost, measured with process
    accounting). A workload that imports torch costs one import a rank there, started cold; under
    torchrun, warm by default, one a node: a test with several ranks a node says `launcher="torchrun"`."""
    launcher = getattr(request.module, "LAUNCHER", None)

    def make(layout: list[tuple[int, int]], **top) -> Path:
        if launcher:
            top.setdefault("launcher", launcher)
        top.setdefault("python", sys.executable)
        top.setdefault("workdir", str(tmp_path))
        top.setdefault("env", {"OMP_NUM_THREADS": 1})
        return cluster.cluster_file(tmp_path / "cluster.yaml", [(cluster.nodes[i], g) for i, g in layout], **top)

    return make


@pytest.fixture(autouse=True)
def no_leaks():
    """Every integration test must end with none of its job processes left, on any node: those of
    the jobs it launched, or launched from its cluster files (procs.TestScope); a user's own job,
    or another test worker's, is not counted."""
    yield
    left = procs.wait_no_job_processes(None, timeout=15)
    assert not left, f"job processes left behind: {left}"


@pytest.fixture
def tmux():
    if not shutil.which("tmux"):
        pytest.skip("needs tmux (apt-get install tmux)")
    # a server of its own per test: the last test's may still be exiting (kill-server does not wait)
    socket = f"ddp-up-test-{os.getpid()}-{secrets.token_hex(3)}"

    def run(*args: str, check: bool = True) -> str:
        return subprocess.run(["tmux", "-L", socket, *args], check=check, capture_output=True, text=True,
                              timeout=30).stdout

    run.socket = socket
    yield run
    run("kill-server", check=False)
