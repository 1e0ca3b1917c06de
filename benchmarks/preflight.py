"""What the preflight's checks cost: the network and GPU checks, and ddp-check --collective.

    python3 -m benchmarks.preflight [--nodes 16] [--repeat 5] [--base REV | --collective-only]

On the namespace SSH cluster:
- ``ddp-check`` of this build against ``ddp-check`` of the build before the checks (``--base``,
  checked out into a temporary git worktree), alternating in each repeat: connect, preflight, the
  probe to the master, and now each node's route, interfaces, hostname and GPU processes;
- ``ddp-check --collective`` (all_reduce at three sizes, then every node's link in two rings), its
  wall time, with every link healthy, warm (the default: torchrun and the probe forked from one
  interpreter a node) and cold (`warm: false`) in turn, and with one node's link shaped to 20 Mbit/s
  (tc tbf).
"""

from __future__ import annotations

import compileall
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import cluster_args, spread, timed
from tests.harness.runner import CHECK, REPO, _env
from tests.harness.sshcluster import SSHCluster

BASE = "16fed74"  # the last build before the network and GPU checks


def ddp_check(source: Path, args: list[str]) -> tuple[float, str]:
    """Wall seconds of one ddp-check run from the package in ``source``."""
    env = {**_env(), "PYTHONPATH": str(source)}
    # a build from before the package's layout (orchestrator/commands/) has its entry points at the top
    code = CHECK if (source / "orchestrator" / "commands").is_dir() else CHECK.replace(".commands.entry", ".entry")
    sample = timed([sys.executable, "-c", code, *args], 300, cwd=source, env=env)
    if sample.code not in (0, 3) or "Traceback" in sample.output:
        raise SystemExit(f"ddp-check failed ({sample.code}):\n{sample.output[-3000:]}")
    return sample.wall, sample.output


def main() -> None:
    args = cluster_args(__doc__, "16", lambda p: (p.add_argument("--base", default=BASE), p.add_argument(
        "--collective-only", action="store_true", help="time --collective alone, without the build before")))
    with tempfile.TemporaryDirectory(prefix="ddp-up-bench-") as tmp_name:
        tmp = Path(tmp_name)
        if args.collective_only:
            for n in args.sizes:
                run_size(n, tmp, None, args.repeat)
            return
        base = tmp / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base), args.base], cwd=REPO, check=True,
                       capture_output=True, timeout=60)
        compileall.compile_dir(str(base / "orchestrator"), quiet=1)  # as compile_like_pip did for this build
        try:
            for n in args.sizes:
                run_size(n, tmp, base, args.repeat)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=REPO, capture_output=True,
                           timeout=60)


def run_size(n: int, tmp: Path, base: Path | None, repeat: int) -> None:
    cluster = SSHCluster(n, tmp / f"cluster{n}")
    cluster.up()
    try:
        path = cluster.cluster_file(tmp / "cluster.yaml", [(node, 1) for node in cluster.nodes],
                                    python=sys.executable, workdir=str(tmp), env={"OMP_NUM_THREADS": 1})
        ours, theirs, gaps = [], [], []
        for r in range(repeat if base is not None else 0):
            got = {}
            for way in (("new", "base") if r % 2 == 0 else ("base", "new")):
                got[way], _ = ddp_check(REPO if way == "new" else base, [str(path)])
            ours.append(got["new"]), theirs.append(got["base"]), gaps.append(got["new"] - got["base"])
            print(f"{n} nodes, repeat {r}: ddp-check {got['new']:.2f} s, before the checks {got['base']:.2f} s",
                  flush=True)
        cold_path = cluster.cluster_file(tmp / "cold.yaml", [(node, 1) for node in cluster.nodes], warm=False,
                                         python=sys.executable, workdir=str(tmp), env={"OMP_NUM_THREADS": 1})
        healthy, cold, shaped = [], [], []
        for r in range(max(1, repeat // 2)):
            for way in (("warm", "cold") if r % 2 == 0 else ("cold", "warm")):
                wall = ddp_check(REPO, ["--collective", str(path if way == "warm" else cold_path)])[0]
                (healthy if way == "warm" else cold).append(wall)
            with cluster.slow_link(cluster.nodes[-1]):
                wall, out = ddp_check(REPO, ["--collective", str(path)])
            if "far slower" not in out:
                raise SystemExit(f"the shaped node was not named:\n{out[-3000:]}")
            shaped.append(wall)
            print(f"{n} nodes, repeat {r}: --collective {healthy[-1]:.1f} s (cold {cold[-1]:.1f} s), one link at "
                  f"20 Mbit/s {wall:.1f} s", flush=True)
    finally:
        cluster.down()
    print(f"\n{n} nodes, 1 process each; median (min-max)\n")
    print("| ddp-check (s) | before the checks (s) | added (s) | --collective (s) | cold (s) | warm / cold | "
          "with a 20 Mbit/s node (s) |")
    print("|---|---|---|---|---|---|---|")
    ratios = [w / c for w, c in zip(healthy, cold)]
    print(f"| {spread(ours) if ours else '-'} | {spread(theirs) if theirs else '-'} | "
          f"{spread(gaps) if gaps else '-'} | {spread(healthy, '{:.1f}')} | "
          f"{spread(cold, '{:.1f}')} | {spread(ratios)} | {spread(shaped, '{:.1f}')} |\n", flush=True)


if __name__ == "__main__":
    main()
