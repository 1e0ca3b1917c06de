"""Launch-to-exit and fan-out at 1..64 nodes: ddp-up against the manual way (parallel ssh).

    python3 -m benchmarks.launch [--nodes 1,4,16,64] [--repeat 3] [--baseline DIR]

On the namespace sshd cluster of the tests (Linux, root), one process per node:
  job      a trivial job (init_process_group + one all_reduce + barrier, gloo) launched by
           `ssh node torchrun ... &` per node then `wait` (the baseline), and by ddp-up
           (connect, ship the agent, preflight, go, relay, exit);
  fan-out  what ddp-up adds before the launcher starts: ddp-check (connect, agent, torch probe,
           TCP probe of the master) against `ssh node python -c <find torch>` per node.
Every repeat runs each (nodes, mode) pair once, interleaved, and ratios are taken within a repeat.
Also prints ddp-up's own CPU seconds and peak RSS, and the machine's peak memory in use. With
--baseline DIR, another checkout's ddp-up (a previous build) launches the same job in every repeat,
and this build's time is printed as a ratio to it.
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.common import (JOB_ENV, SCRIPT, Sample, cluster_args, env_for, parallel_ssh_script, spread, timed,
                               torchrun_line)
from tests.harness.runner import CHECK, REPO, UP, _env
from tests.harness.sshcluster import SSHCluster

JOB = ["run", "--steps", "0"]
FIND_TORCH = "import importlib.util as u, sys; sys.exit(0 if u.find_spec('torch') else 1)"
TIMEOUT = 900


class MemoryWatch:
    """Peak of the machine's memory in use (MemTotal - MemAvailable) while a command runs."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> MemoryWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
            used = int(info["MemTotal"].split()[0]) - int(info["MemAvailable"].split()[0])
            self.peak = max(self.peak, used)


class Bench:
    def __init__(self, cluster: SSHCluster, tmp: Path):
        self.cluster = cluster
        self.tmp = tmp
        self.runs = tmp / "runs"

    def cluster_file(self, n: int) -> Path:
        return self.cluster.cluster_file(self.tmp / f"c{n}.yaml", [(node, 1) for node in self.cluster.nodes[:n]],
                                         python=sys.executable, workdir=str(self.tmp),
                                         env=JOB_ENV, ssh={"connect_timeout": 30})

    def ddp_up(self, n: int, tree: Path | None = None) -> tuple[Sample, int]:
        """``tree``: another checkout's ddp-up (the baseline build)."""
        with MemoryWatch() as mem:
            s = timed([sys.executable, "-c", UP, "--no-dashboard", "--runs-dir", str(self.runs),
                       str(self.cluster_file(n)), SCRIPT, *JOB], TIMEOUT, cwd=tree or REPO, env=env_for(tree))
        return _ok(s, f"ddp-up at {n} nodes"), mem.peak

    def ssh_job(self, n: int) -> tuple[Sample, int]:
        nodes, port, tag = self.cluster.nodes[:n], random.randint(20000, 40000), f"bench-{time.time_ns()}"
        script = parallel_ssh_script(self.cluster, nodes,
                                     lambda k: torchrun_line(nodes, k, port, str(self.tmp), tag, JOB))
        with MemoryWatch() as mem:
            s = timed(["bash", "-c", script], TIMEOUT)
        return _ok(s, f"parallel ssh at {n} nodes"), mem.peak

    def ddp_check(self, n: int) -> Sample:
        return _ok(timed([sys.executable, "-c", CHECK, str(self.cluster_file(n))], TIMEOUT, cwd=REPO, env=_env()),
                   f"ddp-check at {n} nodes")

    def ssh_probe(self, n: int) -> Sample:
        remote = f"{sys.executable} -c \"{FIND_TORCH}\""
        script = parallel_ssh_script(self.cluster, self.cluster.nodes[:n], lambda k: remote)
        return _ok(timed(["bash", "-c", script], TIMEOUT), f"parallel ssh probe at {n} nodes")


def _ok(s: Sample, what: str) -> Sample:
    if s.code != 0:
        raise SystemExit(f"{what} failed with exit status {s.code}:\n{s.output[-3000:]}")
    return s


def main() -> int:
    args = cluster_args(__doc__, nodes="1,4,16,64", baseline=True)
    sizes = args.sizes
    job: dict[int, list[tuple[Sample, int, Sample, int]]] = {n: [] for n in sizes}
    fan: dict[int, list[tuple[Sample, Sample]]] = {n: [] for n in sizes}
    before: dict[int, list[tuple[Sample, Sample]]] = {n: [] for n in sizes}  # (this build, baseline)
    with tempfile.TemporaryDirectory() as tmp:
        cluster = SSHCluster(max(sizes), Path(tmp) / "cluster").up()
        try:
            bench = Bench(cluster, Path(tmp))
            for r in range(args.repeat):
                for n in sizes:
                    base, base_mem = bench.ssh_job(n)
                    ours, ours_mem = bench.ddp_up(n)
                    job[n].append((base, base_mem, ours, ours_mem))
                    fan[n].append((bench.ssh_probe(n), bench.ddp_check(n)))
                    if args.baseline:
                        before[n].append((ours, bench.ddp_up(n, args.baseline)[0]))
                    print(f"  repeat {r + 1}, {n} nodes: ssh {base.wall:.2f} s, ddp-up {ours.wall:.2f} s, "
                          f"probe {fan[n][-1][0].wall:.2f} s, ddp-check {fan[n][-1][1].wall:.2f} s",
                          file=sys.stderr, flush=True)
        finally:
            cluster.down()
    report(sizes, job, fan, args.repeat)
    if args.baseline:
        report_baseline(sizes, before, args.baseline)
    return 0


def report_baseline(sizes, before, baseline: Path) -> None:
    print(f"\nthis build against {baseline} (same job, same repeat); median (min-max)")
    print(f"{'nodes':>5} {'this build s':>20} {'baseline s':>20} {'this/baseline':>18} {'CPU this s':>18} "
          f"{'CPU baseline s':>18}")
    for n in sizes:
        runs = before[n]
        print(f"{n:>5} {spread([a.wall for a, _ in runs]):>20} {spread([b.wall for _, b in runs]):>20} "
              f"{spread([a.wall / b.wall for a, b in runs]):>18} {spread([a.cpu for a, _ in runs]):>18} "
              f"{spread([b.cpu for _, b in runs]):>18}")


def report(sizes, job, fan, repeat) -> None:
    print(f"\nlaunch-to-exit of a trivial job (init_process_group + all_reduce, gloo), 1 process per node, "
          f"{repeat} runs; median (min-max)")
    print(f"{'nodes':>5} {'ssh & wait s':>20} {'ddp-up s':>20} {'ddp-up/ssh':>18} {'ddp-up CPU s':>18} "
          f"{'ddp-up RSS MB':>14} {'machine mem GB':>15}")
    for n in sizes:
        runs = job[n]
        ratios = [ours.wall / base.wall for base, _, ours, _ in runs]
        print(f"{n:>5} {spread([r[0].wall for r in runs]):>20} {spread([r[2].wall for r in runs]):>20} "
              f"{spread(ratios):>18} {spread([r[2].cpu for r in runs]):>18} "
              f"{statistics.median(r[2].max_rss_mb for r in runs):>14.0f} "
              f"{max(max(r[1], r[3]) for r in runs) / 2**20:>15.1f}")
    first = sizes[0]
    for n in sizes[1:]:
        ours = statistics.median(r[2].wall for r in job[n]) / statistics.median(r[2].wall for r in job[first])
        base = statistics.median(r[0].wall for r in job[n]) / statistics.median(r[0].wall for r in job[first])
        print(f"  {n} vs {first} nodes: ddp-up x{ours:.2f}, ssh x{base:.2f} "
              f"(the job itself grows: {n} torchruns and {n} workers import torch on the same 2 cores)")
    print("\nfan-out before launch: ddp-check vs `ssh node python -c <find torch>` & wait; median (min-max)")
    print(f"{'nodes':>5} {'ssh probe s':>20} {'ddp-check s':>20} {'ddp-check/ssh':>18} {'ddp-check CPU s':>18}")
    for n in sizes:
        runs = fan[n]
        print(f"{n:>5} {spread([b.wall for b, _ in runs]):>20} {spread([c.wall for _, c in runs]):>20} "
              f"{spread([c.wall / b.wall for b, c in runs]):>18} {spread([c.cpu for _, c in runs]):>18}")


if __name__ == "__main__":
    sys.exit(main())
