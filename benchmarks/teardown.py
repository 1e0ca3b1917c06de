"""Teardown latency at N nodes: from a fault to zero job processes on every node.

Runs on the same namespace sshd cluster as the integration tests (Linux, root):

    python3 -m benchmarks.teardown [--nodes 4] [--repeat 3]

Prints one row per fault: median and min-max of (fault -> ddp-up exit) and (fault -> no tagged
process left anywhere), over --repeat runs. Jobs are 1 process per node, stop_grace 10 s.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tests.harness import procs
from tests.harness.runner import Launch, ddp_kill
from tests.harness.sshcluster import SSHCluster, available

from benchmarks.common import SCRIPT, compile_like_pip  # noqa: E402  (SCRIPT re-exported for benchmarks.logs)
LONG_RUN = ["run", "--steps", "100000", "--step-time", "0.2"]
ORPHAN_TIMEOUT = 5


def fault_ctrl_c(launch, job, cluster, path):
    launch.signal(signal.SIGINT)


def fault_worker_sigkill(launch, job, cluster, path):
    os.kill(procs.worker_pid(job, len(cluster.nodes) - 1), signal.SIGKILL)


def fault_agent_sigkill(launch, job, cluster, path):
    os.kill(procs.agent_pid(job, len(cluster.nodes) - 1), signal.SIGKILL)


def fault_sshd_session(launch, job, cluster, path):
    os.kill(procs.parent_pid(procs.agent_pid(job, len(cluster.nodes) - 1)), signal.SIGKILL)


def fault_controller_sigkill(launch, job, cluster, path):
    launch.signal(signal.SIGKILL)


def fault_partition(launch, job, cluster, path):
    cluster.partition(cluster.nodes[-1])


def fault_ddp_kill(launch, job, cluster, path):
    code, out = ddp_kill(str(path), "--job", job)
    assert code == 0, out


FAULTS = {
    "Ctrl-C (graceful stop)": fault_ctrl_c,
    "worker SIGKILL (fail-fast)": fault_worker_sigkill,
    "agent SIGKILL (lost, swept)": fault_agent_sigkill,
    "sshd session killed": fault_sshd_session,
    "ddp-up SIGKILL (EOF on nodes)": fault_controller_sigkill,
    f"partition (orphan_timeout {ORPHAN_TIMEOUT})": fault_partition,
    "ddp-kill --job": fault_ddp_kill,
}


def one_run(cluster: SSHCluster, path: Path, fault) -> tuple[float, float]:
    launch = Launch([str(path), SCRIPT, *LONG_RUN])
    launch.wait_line(r"\| step 1 rank=0", 120)
    job = launch.job_id
    t0 = time.monotonic()
    try:
        fault(launch, job, cluster, path)
        launch.wait(120)
        exited = time.monotonic() - t0
        left = procs.wait_no_job_processes(job, 60)
        assert not left, left
        return exited, time.monotonic() - t0
    finally:
        cluster.heal(cluster.nodes[-1])
        if launch.proc.poll() is None:
            launch.proc.kill()


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):6.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    compile_like_pip()
    if reason := available():
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        cluster = SSHCluster(args.nodes, Path(tmp) / "cluster").up()
        try:
            path = cluster.cluster_file(Path(tmp) / "c.yaml", [(n, 1) for n in cluster.nodes],
                                        python=sys.executable, workdir=tmp, env={"OMP_NUM_THREADS": 1},
                                        orphan_timeout=ORPHAN_TIMEOUT, stop_grace=10)
            print(f"teardown at {args.nodes} nodes x 1 process, {args.repeat} runs each; seconds, median (min-max)")
            print(f"{'fault':36} {'fault -> ddp-up exit':>22} {'fault -> zero processes':>24}")
            for name, fault in FAULTS.items():
                runs = [one_run(cluster, path, fault) for _ in range(args.repeat)]
                print(f"{name:36} {spread([r[0] for r in runs]):>22} {spread([r[1] for r in runs]):>24}", flush=True)
        finally:
            cluster.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
