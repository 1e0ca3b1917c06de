"""Warm start against a cold start and against the manual way, launch to exit, in one run.

    python3 -m benchmarks.warm [--nodes 1,4] [--repeat 3] [--procs 1] [--launcher torchrun]

On the namespace sshd cluster of the tests (Linux, root), --procs processes per node, the trivial job
of benchmarks/launch.py (init_process_group + one all_reduce, gloo), each repeat in turn:
  manual   `ssh node torchrun ...` per node, then `wait` (what a user types by hand)
  cold     ddp-up with --launcher (torchrun, or none: ddp-up's own): every rank imports torch
           after the Go
  warm     the same with `warm: true` (the default): every node imports torch once, while the
           preflight runs, and forks its ranks from that interpreter
Each is timed to every rank's first line (its process group up) and to its exit.
Ratios are taken within a repeat; the machine's peak memory in use is printed for each. These
machines have 2 cores: every node's imports are paid on the same two.
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import (JOB_ENV, SCRIPT, Sample, cluster_args, env_for, parallel_ssh_script, spread, timed,
                               torchrun_line)
from benchmarks.launch import JOB, TIMEOUT, Bench, MemoryWatch, _ok
from tests.harness.runner import REPO, UP
from tests.harness.sshcluster import SSHCluster

MODES = ("cold", "warm")
READY = r"READY rank=\d+ "  # each rank's first line, once its process group is up (tests/scripts/job.py)


class WarmBench(Bench):
    def __init__(self, cluster: SSHCluster, tmp: Path, procs: int, launcher: str):
        super().__init__(cluster, tmp)
        self.procs, self.launcher = procs, launcher

    def cluster_file(self, n: int) -> Path:
        return self.cluster.cluster_file(self.tmp / f"c{n}.yaml", [(node, self.procs) for node in self.cluster.nodes[:n]],
                                         python=sys.executable, workdir=str(self.tmp), env=JOB_ENV,
                                         ssh={"connect_timeout": 30})

    def ssh_job(self, n: int) -> tuple[Sample, int]:
        nodes, port, tag = self.cluster.nodes[:n], random.randint(20000, 40000), f"bench-{time.time_ns()}"
        script = parallel_ssh_script(self.cluster, nodes, lambda k: torchrun_line(
            nodes, k, port, str(self.tmp), tag, JOB, self.procs))
        with MemoryWatch() as mem:
            s = timed(["bash", "-c", script], TIMEOUT, lines=(READY, n * self.procs))
        return _ok(s, f"parallel ssh at {n} nodes"), mem.peak

    def ddp_up_mode(self, n: int, mode: str) -> tuple[Sample, int]:
        path = self.cluster_file(n)
        text = path.read_text() + f"launcher: {self.launcher}\nwarm: {'true' if mode == 'warm' else 'false'}\n"
        path = path.with_name(f"{path.stem}-{mode}.yaml")
        path.write_text(text)
        with MemoryWatch() as mem:
            s = timed([sys.executable, "-c", UP, "--no-dashboard", "--runs-dir", str(self.runs), str(path), SCRIPT,
                       *JOB], TIMEOUT, lines=(READY, n * self.procs), cwd=REPO, env=env_for(None))
        return _ok(s, f"ddp-up {mode} at {n} nodes"), mem.peak


def main() -> int:
    def more(p) -> None:
        p.add_argument("--procs", type=int, default=1)
        p.add_argument("--launcher", choices=("torchrun", "none"), default="torchrun")

    args = cluster_args(__doc__, "1,4", more)
    rows: dict[int, list[dict]] = {n: [] for n in args.sizes}
    with tempfile.TemporaryDirectory() as tmp:
        cluster = SSHCluster(max(args.sizes), Path(tmp) / "cluster").up()
        try:
            bench = WarmBench(cluster, Path(tmp), args.procs, args.launcher)
            for r in range(args.repeat):
                for n in args.sizes:
                    manual, manual_mem = bench.ssh_job(n)
                    row = {"manual": (manual, manual_mem)}
                    for mode in MODES:
                        row[mode] = bench.ddp_up_mode(n, mode)
                    rows[n].append(row)
                    print(f"  repeat {r + 1}, {n} nodes: " + ", ".join(
                        f"{k} {v[0].wall:.2f} s" for k, v in row.items()), file=sys.stderr, flush=True)
        finally:
            cluster.down()
    report_first_lines(args, rows)
    print(f"\nlaunch to exit of a trivial torch job, {args.procs} process(es) per node, launcher {args.launcher}, "
          f"{args.repeat} runs; median (min-max), s")
    print("| nodes | manual ssh + torchrun | ddp-up cold | ddp-up warm | warm / manual | warm / cold "
          "| peak memory GB manual / cold / warm |")
    print("|---|---|---|---|---|---|---|")
    for n in args.sizes:
        runs = rows[n]

        def wall(mode):
            return [run[mode][0].wall for run in runs]

        def peak(mode):
            return max(run[mode][1] for run in runs) / 2**20
        print(f"| {n} | {spread(wall('manual'))} | {spread(wall('cold'))} | {spread(wall('warm'))} "
              f"| {spread([w / m for w, m in zip(wall('warm'), wall('manual'))])} "
              f"| {spread([w / c for w, c in zip(wall('warm'), wall('cold'))])} "
              f"| {peak('manual'):.1f} / {peak('cold'):.1f} / {peak('warm'):.1f} |")
    return 0


def report_first_lines(args, rows: dict[int, list[dict]]) -> None:
    print(f"\nlaunch to every rank's first line (its process group up), {args.procs} process(es) per node, "
          f"launcher {args.launcher}, {args.repeat} runs; median (min-max), s")
    print("| nodes | manual ssh + torchrun | ddp-up cold | ddp-up warm | warm / manual | warm / cold |")
    print("|---|---|---|---|---|---|")
    for n in args.sizes:
        def first(mode):
            return [run[mode][0].lines_at for run in rows[n]]

        def ratios(a, b):  # the runs where both saw every rank's line
            return [x / y if x is not None and y is not None else None for x, y in zip(first(a), first(b))]
        print(f"| {n} | {seen(first('manual'))} | {seen(first('cold'))} | {seen(first('warm'))} "
              f"| {seen(ratios('warm', 'manual'))} | {seen(ratios('warm', 'cold'))} |")


def seen(values: list) -> str:
    """spread of the values there are, and how many of the runs they are where some are missing."""
    there = [v for v in values if v is not None]
    if not there:
        return "-"
    return spread(there) + (f" ({len(there)} of {len(values)} runs)" if len(there) < len(values) else "")


if __name__ == "__main__":
    sys.exit(main())
