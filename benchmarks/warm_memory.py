"""A node's memory with its ranks running, warm against cold, in one run.

    python3 -m benchmarks.warm_memory [--repeat 3] [--procs 4] [--launcher torchrun|none]

One `transport: local` node, --procs ranks of a torch job that holds still once its process group
is up (tests/scripts/job.py), each repeat cold (`warm: false`) then warm (the default). Once every
rank has printed its first line, the proportional set size (PSS: a page shared by N processes
counts 1/N to each) of every process of the job on the node is summed: the agent, torchrun, the
ranks and, warm, the interpreter they were forked from and torchrun's stand-ins. The job is then
stopped with Ctrl-C. No root and no namespaces needed.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

from benchmarks.common import Watched, spread
from orchestrator.node.local.procs import find_tagged
from tests.harness.runner import REPO, UP, _env

HOLD = ["run", "--steps", "100000", "--step-time", "0.2"]


def pss_kib(pid: int) -> int:
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:  # gone meanwhile
        return 0
    found = re.search(r"^Pss:\s+(\d+) kB", text, re.M)
    return int(found.group(1)) if found else 0


def measure(cluster: Path, runs: Path, procs: int) -> float:
    """MiB of PSS of the job's processes with every rank up."""
    job = Watched([sys.executable, "-c", UP, "--no-dashboard", "--runs-dir", str(runs), str(cluster),
                   str(REPO / "tests" / "scripts" / "job.py"), *HOLD], cwd=REPO, env=_env())
    try:
        job.wait_for(lambda text: len(re.findall(r"READY rank=\d+ ", text)) >= procs, 600)
        job_id = re.search(r"job (\d{8}-\d{6}-\w+)", job.text).group(1)
        return sum(pss_kib(p["pid"]) for p in find_tagged({"DDP_UP_JOB": job_id})) / 1024
    finally:
        job.ctrl_c()
        if job.wait(120) is None:
            job.kill()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--launcher", choices=("torchrun", "none"), default="torchrun")
    args = p.parse_args()
    import yaml

    rows: dict[str, list[float]] = {"cold": [], "warm": []}
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        for r in range(args.repeat):
            for mode in rows:
                cluster = where / f"{mode}.yaml"
                cluster.write_text(yaml.safe_dump({
                    "transport": "local", "python": sys.executable, "workdir": str(where), "launcher": args.launcher,
                    "warm": mode == "warm", "env": {"OMP_NUM_THREADS": 1, "JOB_PG_TIMEOUT": "600"},
                    "nodes": [{"host": "local-0", "gpus": args.procs}]}))
                rows[mode].append(measure(cluster, where / "runs", args.procs))
                print(f"  repeat {r + 1} {mode}: {rows[mode][-1]:.0f} MiB", file=sys.stderr, flush=True)
    print(f"\nPSS of a node's job processes, {args.procs} ranks running, launcher {args.launcher}, "
          f"{args.repeat} runs; median (min-max), MiB")
    print("| cold | warm | warm / cold |")
    print("|---|---|---|")
    print(f"| {spread(rows['cold'], '{:.0f}')} | {spread(rows['warm'], '{:.0f}')} "
          f"| {spread([w / c for w, c in zip(rows['warm'], rows['cold'])])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
