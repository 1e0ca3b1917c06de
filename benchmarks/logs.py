"""Log path cost: does carrying a print-heavy job's output slow the job down?

    python3 -m benchmarks.logs [--nodes 2] [--procs 2] [--lines 200000] [--repeat 3]
    python3 -m benchmarks.logs --updates 100000 ...    (progress-bar updates instead of lines)

On the namespace sshd cluster, every rank prints --lines lines (~100 bytes) as fast as it can
and times its own print loop. Three ways, interleaved in each repeat:
  file       output to a file on the node (the baseline: ddp-up carries nothing)
  plain      through ddp-up to the console (--no-dashboard)
  dashboard  through ddp-up with the live dashboard forced on
Prints the median print-loop time per mode, its ratio to the baseline, the end-to-end wall time,
delivered lines/s, and checks that the run's rank log files hold every line. With --updates,
every rank draws that many "\\r" progress-bar updates instead (flushed each, as tqdm does), and
the check is that each rank log ends the bar with its final state, one line.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import compile_like_pip
from benchmarks.teardown import SCRIPT
from tests.harness.runner import REPO, UP, _env
from tests.harness.sshcluster import SSHCluster, available

MODES = ("file", "plain", "dashboard")
BARS = str(Path(SCRIPT).with_name("bars.py"))


def run(path: Path, mode: str, lines: int, runs: Path, tmp: str,
        controller_cpus: set[int] | None, updates: bool = False) -> tuple[float, float, int, float]:
    """(median rank print-loop s, wall s, lines (or final bar lines) found in the run's rank logs,
    controller CPU s)."""
    view = ["--dashboard"] if mode == "dashboard" else ["--no-dashboard"]
    script, word = (BARS, "flood") if updates else (SCRIPT, "spam")
    args = [word, str(lines)] + ([f"{tmp}/{word}"] if mode == "file" else [])
    t0, cpu0 = time.monotonic(), _children_cpu()
    proc = subprocess.run([sys.executable, "-c", UP, *view, "--runs-dir", str(runs), str(path), script, *args],
                          cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=900,
                          preexec_fn=(lambda: os.sched_setaffinity(0, controller_cpus)) if controller_cpus else None)
    wall, cpu = time.monotonic() - t0, _children_cpu() - cpu0  # the ddp-up process only: nodes are via sshd
    out = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, out[-3000:]
    job = re.search(r"job (\d{8}-\d{6}-\w+)", out).group(1)
    logs = _rank_logs(runs / job)
    seconds = [float(s) for s in re.findall(r"(?:SPAM|FLOOD) rank=\d+ \w+=\d+ seconds=([\d.]+)", logs)]
    if updates:
        delivered = sum(1 for line in logs.split("\n") if line == f"update {lines}/{lines}")
    else:
        delivered = sum(1 for line in logs.splitlines() if line.startswith("rank "))
    return statistics.median(seconds), wall, delivered, cpu


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _rank_logs(d: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted(d.glob("rank*.log")))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--lines", type=int, default=200_000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--updates", type=int, default=None,
                   help="each rank draws this many \\r progress-bar updates instead of printing --lines lines")
    p.add_argument("--split-cpus", action="store_true",
                   help="run ddp-up on the last CPU and the nodes on the others, as if the controller were "
                        "another machine (needs 2+ CPUs)")
    args = p.parse_args()
    compile_like_pip()
    if reason := available():
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    ranks = args.nodes * args.procs
    with tempfile.TemporaryDirectory() as tmp:
        cluster = SSHCluster(args.nodes, Path(tmp) / "cluster").up()
        controller_cpus = None
        try:
            if args.split_cpus:
                cpus = sorted(os.sched_getaffinity(0))
                controller_cpus, node_cpus = {cpus[-1]}, set(cpus[:-1])
                for node in cluster.nodes:  # every process a node starts inherits its sshd's CPUs
                    for pid in cluster.namespace_pids(node):
                        os.sched_setaffinity(pid, node_cpus)
            path = cluster.cluster_file(Path(tmp) / "c.yaml", [(n, args.procs) for n in cluster.nodes],
                                        python=sys.executable, workdir=tmp, env={"OMP_NUM_THREADS": 1})
            results: dict[str, list[tuple[float, float, int, float]]] = {m: [] for m in MODES}
            for _ in range(args.repeat):
                for mode in MODES:  # interleaved, so drift on a noisy machine hits every mode alike
                    results[mode].append(run(path, mode, args.updates or args.lines, Path(tmp) / "runs", tmp,
                                             controller_cpus, updates=args.updates is not None))
        finally:
            cluster.down()
    base = statistics.median(r[0] for r in results["file"])
    what = f"{args.updates} bar updates" if args.updates else f"{args.lines} lines"
    print(f"log path: {args.nodes} nodes x {args.procs} procs, {what} per rank, {args.repeat} runs "
          f"per mode; median (min-max)"
          + ("; controller on its own CPU" if controller_cpus else "; controller shares the nodes' CPUs"))
    print(f"{'mode':10} {'print loop s':>22} {'vs file':>8} {'wall s':>20} {'lines/s delivered':>18} "
          f"{'complete':>9} {'ddp-up CPU s':>13}")
    for mode in MODES:
        loops, walls = [r[0] for r in results[mode]], [r[1] for r in results[mode]]
        loop = statistics.median(loops)
        expected = ranks if args.updates else ranks * args.lines
        complete = "-" if mode == "file" else ("yes" if all(r[2] == expected for r in results[mode]) else "NO")
        rate = "-" if mode == "file" else f"{ranks * (args.updates or args.lines) / statistics.median(walls):,.0f}"
        print(f"{mode:10} {loop:8.3f} ({min(loops):.3f}-{max(loops):.3f}) {loop / base:8.2f} "
              f"{statistics.median(walls):7.2f} ({min(walls):.2f}-{max(walls):.2f}) {rate:>18} {complete:>9} "
              f"{statistics.median(r[3] for r in results[mode]):13.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
