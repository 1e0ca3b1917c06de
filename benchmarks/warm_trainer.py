"""The Lightning example, launch to its first training step and to its exit: cold, warm, and warm
with Lightning preloaded, in one run.

    python3 -m benchmarks.warm_trainer [--repeat 3] [--nodes 2] [--procs 1]

On `transport: local` nodes (no root, no namespaces), under torchrun, each repeat in turn:
  cold      `warm: false`: torchrun and every rank import torch, then the rank imports Lightning
  warm      the default: each node imports torch once, before the launch; the ranks import Lightning
  preload   `preload: [lightning]` too: the ranks begin with Lightning imported
The script is examples/lightning_train.py as it is (one epoch), through
benchmarks/lightning_first_step.py, which prints each rank's first step.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from benchmarks.common import spread, timed
from tests.harness.runner import REPO, UP, _env

MODES = {"cold": {"warm": False}, "warm": {"warm": True}, "preload": {"warm": True, "preload": ["lightning"]}}
SCRIPT = str(REPO / "benchmarks" / "lightning_first_step.py")
TIMEOUT = 900


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--procs", type=int, default=1)
    args = p.parse_args()
    import yaml

    ranks = args.nodes * args.procs
    rows: dict[str, list] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        for r in range(args.repeat):
            for mode, keys in MODES.items():
                cluster = where / f"{mode}.yaml"
                cluster.write_text(yaml.safe_dump({
                    "transport": "local", "python": sys.executable, "workdir": str(where), **keys,
                    "env": {"OMP_NUM_THREADS": 1, "CUDA_VISIBLE_DEVICES": ""},  # the example trains on CPUs
                    "nodes": [{"host": f"local-{i}", "gpus": args.procs} for i in range(args.nodes)]}))
                s = timed([sys.executable, "-c", UP, "--no-dashboard", "--runs-dir", str(where / "runs"), str(cluster),
                           SCRIPT, "--epochs", "1", "--out", str(where / f"ckpt-{mode}-{r}")], TIMEOUT,
                          lines=(r"FIRST STEP rank=\d+", ranks), cwd=REPO, env=_env())
                if s.code != 0 or s.lines_at is None:
                    raise SystemExit(f"{mode} failed ({s.code}):\n{s.output[-3000:]}")
                rows[mode].append(s)
                print(f"  repeat {r + 1} {mode}: first step {s.lines_at:.2f} s, exit {s.wall:.2f} s", file=sys.stderr,
                      flush=True)
    print(f"\nthe Lightning example, {args.nodes} nodes x {args.procs}, torchrun, {args.repeat} runs; "
          "median (min-max), s")
    print("| | launch to first step | launch to exit | first step / cold |")
    print("|---|---|---|---|")
    cold = [s.lines_at for s in rows["cold"]]
    for mode, runs in rows.items():
        first = [s.lines_at for s in runs]
        print(f"| {mode} | {spread(first)} | {spread([s.wall for s in runs])} "
              f"| {spread([f / c for f, c in zip(first, cold)])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
