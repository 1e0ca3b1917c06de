"""A second `orchestrator.launch()` from the same Python session, warm against cold, in one run.

    python3 -m benchmarks.relaunch [--repeat 3] [--launcher torchrun|none] [--nodes 2] [--procs 2]

Each repeat, in turn: a fresh Python session that launches a trivial function (it returns its
rank's parent pid) twice on `transport: local` nodes, with `warm: false` (cold: every launch
imports torch on every rank), then one with warm start (the default: the first launch makes each
node's warm interpreter, the second forks its ranks from it). Seconds from the call to its
return; the second launch's ranks must be the same interpreter's children as the first's.
No root and no namespaces needed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import spread
from tests.harness.runner import REPO

SESSION = """
import json, sys, time
from orchestrator import launch

def parent():
    import os
    return os.getppid()

times, parents = [], []
for _ in range(2):
    started = time.monotonic()
    run = launch(sys.argv[1], parent, runs_dir=sys.argv[2])
    times.append(time.monotonic() - started)
    parents.append(sorted(set(run.results.values())))
print("RESULT " + json.dumps({"times": times, "parents": parents}), flush=True)
"""
TIMEOUT = 600


def session(cluster: Path, runs: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", SESSION, str(cluster), str(runs)], cwd=REPO, capture_output=True,
                         text=True, timeout=TIMEOUT)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if out.returncode != 0 or line is None:
        raise SystemExit(f"the session failed ({out.returncode}):\n{(out.stdout + out.stderr)[-3000:]}")
    return json.loads(line[len("RESULT "):])


def cluster_file(where: Path, mode: str, args: argparse.Namespace) -> Path:
    import yaml

    path = where / f"{mode}.yaml"
    path.write_text(yaml.safe_dump({
        "transport": "local", "python": sys.executable, "workdir": str(where), "launcher": args.launcher,
        "warm": mode == "warm", "env": {"OMP_NUM_THREADS": 1},
        "nodes": [{"host": f"local-{i}", "gpus": args.procs} for i in range(args.nodes)]}))
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--launcher", choices=("torchrun", "none"), default="torchrun")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--procs", type=int, default=2)
    args = p.parse_args()
    rows: dict[str, list[dict]] = {"cold": [], "warm": []}
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        for r in range(args.repeat):
            for mode in rows:
                result = session(cluster_file(where, mode, args), where / "runs")
                if mode == "warm" and result["parents"][0] != result["parents"][1]:
                    raise SystemExit(f"the second warm launch did not fork from the first's interpreters: {result}")
                rows[mode].append(result)
                print(f"  repeat {r + 1} {mode}: " + ", ".join(f"{t:.2f} s" for t in result["times"]),
                      file=sys.stderr, flush=True)
    print(f"\nlaunch() of a trivial function, {args.nodes} local nodes x {args.procs}, launcher {args.launcher}, "
          f"{args.repeat} sessions each; median (min-max), s")
    print("| | first launch() | second launch() | second / first |")
    print("|---|---|---|---|")
    for mode, runs in rows.items():
        first, second = [run["times"][0] for run in runs], [run["times"][1] for run in runs]
        print(f"| {mode} | {spread(first)} | {spread(second)} | {spread([b / a for a, b in zip(first, second)])} |")
    cold, warm = [run["times"][1] for run in rows["cold"]], [run["times"][1] for run in rows["warm"]]
    print(f"\nsecond launch, warm / cold: {spread([w / c for w, c in zip(warm, cold)])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
