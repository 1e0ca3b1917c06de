"""Stop latency: from Ctrl-C to zero job processes on every node, ddp-up against the manual way.

    python3 -m benchmarks.stop [--nodes 4,16] [--repeat 3]

On the namespace sshd cluster of the tests (Linux, root), one process per node, a job that prints
a step every 0.2 s. Once every rank has printed step 1, Ctrl-C (SIGINT to the foreground process
group, as a terminal sends it) goes to:
  ddp-up            the launch under test (stop_grace 10 s: what it may spend, not what it needs)
  ssh -tt + trap    the careful manual way: `trap 'kill 0' INT` in the script, and a remote tty so
                    a closed connection hangs up the remote launcher
  ssh &             the usual manual way: the script dies; its background ssh clients and the
                    remote jobs do not (counted after a bounded wait, then swept by tag)
Prints median (min-max) seconds to zero processes, and what was left where they never reach zero.
"""

from __future__ import annotations

import re
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import JOB_ENV, SCRIPT, cluster_args, Watched, parallel_ssh_script, spread, torchrun_line
from orchestrator.node.local.procs import kill_tagged
from tests.harness import procs
from tests.harness.runner import REPO, UP, _env
from tests.harness.sshcluster import SSHCluster

LONG_JOB = ["run", "--steps", "100000", "--step-time", "0.2"]
STARTUP = 300  # bound on a launch reaching step 1 (64 torch imports on 2 cores take a while)
GIVE_UP = 20.0  # after Ctrl-C: a job still running after this is reported as left behind


def all_ranks_stepping(n: int):
    return lambda text: len(set(re.findall(r"step [1-9]\d* rank=(\d+)", text))) == n


def measure(watched: Watched, n: int, tag_of) -> tuple[float | None, int]:
    """(seconds from Ctrl-C to zero tagged processes, or None; processes left at GIVE_UP)."""
    try:
        watched.wait_for(all_ranks_stepping(n), STARTUP)
        tag = tag_of(watched)
        t0 = time.monotonic()
        watched.ctrl_c()
        left = procs.wait_no_job_processes(tag, GIVE_UP)
        return (None if left else time.monotonic() - t0), len(left)
    finally:
        watched.kill()


def ddp_up(cluster: SSHCluster, tmp: Path, n: int) -> tuple[float | None, int]:
    path = cluster.cluster_file(tmp / f"c{n}.yaml", [(node, 1) for node in cluster.nodes[:n]],
                                python=sys.executable, workdir=str(tmp), env=JOB_ENV,
                                stop_grace=10, ssh={"connect_timeout": 30})
    w = Watched([sys.executable, "-c", UP, "--no-dashboard", "--runs-dir", str(tmp / "runs"), str(path), SCRIPT,
                 *LONG_JOB], cwd=REPO, env=_env())
    return measure(w, n, lambda w: re.search(r"job (\d{8}-\d{6}-\w+)", w.text).group(1))


def manual(cluster: SSHCluster, tmp: Path, n: int, careful: bool) -> tuple[float | None, int]:
    nodes, tag = cluster.nodes[:n], f"bench-{time.time_ns()}"
    port = 20000 + time.time_ns() % 20000
    script = parallel_ssh_script(cluster, nodes, lambda k: torchrun_line(nodes, k, port, str(tmp), tag, LONG_JOB),
                                 tty=careful, trap=careful)
    try:
        return measure(Watched(["bash", "-c", script]), n, lambda w: tag)
    finally:
        kill_tagged({"DDP_UP_JOB": tag}, grace=0)  # what a user would do with ps | grep | kill


MODES = {
    "ddp-up": lambda c, t, n: ddp_up(c, t, n),
    "ssh -tt + trap": lambda c, t, n: manual(c, t, n, careful=True),
    "ssh &": lambda c, t, n: manual(c, t, n, careful=False),
}


def main() -> int:
    args = cluster_args(__doc__, nodes="4,16")
    sizes = args.sizes
    results = {(n, m): [] for n in sizes for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        cluster = SSHCluster(max(sizes), Path(tmp) / "cluster").up()
        try:
            for _ in range(args.repeat):
                for n in sizes:
                    for mode, run in MODES.items():
                        results[n, mode].append(run(cluster, Path(tmp), n))
                        print(f"  {n} nodes, {mode}: {results[n, mode][-1]}", file=sys.stderr, flush=True)
        finally:
            cluster.down()
    print(f"\nCtrl-C to zero job processes on every node, 1 process per node, {args.repeat} runs; "
          f"seconds, median (min-max)")
    print(f"{'nodes':>5} {'mode':16} {'seconds':>20} {'left behind':>24}")
    for (n, mode), runs in results.items():
        times = [t for t, _ in runs if t is not None]
        stuck = [left for t, left in runs if t is None]
        shown = spread(times) if times else "never"
        left = f"{len(stuck)}/{len(runs)} runs, {max(stuck)} procs after {GIVE_UP:.0f} s" if stuck else "-"
        print(f"{n:>5} {mode:16} {shown:>20} {left:>24}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
