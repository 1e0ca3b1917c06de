"""How fast a run changes size: a node's loss to the smaller run's first step, and its return to the
grown run's first step, warm and cold, against a cold relaunch by hand on the nodes.

    python3 -m benchmarks.elastic [--nodes 4] [--repeat 3]

On the namespace SSH cluster, one process per node, examples/train.py --checkpoint (a DDP step
of a tiny model with gloo, torch imported, resumed from the checkpoint at each size):
- ddp-up, `min_nodes:` one less than the nodes, `rejoin_after: 1`, `orphan_timeout: 3`, warm (the
  default under torchrun) and cold (`warm: false`): the last node's link is cut after step 3;
  "loss" is from the cut to the first step of the smaller attempt (the loss is found by
  orphan_timeout, the attempt stops, the next starts on the nodes left); then the link is
  restored: "return" is from then to the first step at the full size (the node answers, for
  rejoin_after, the smaller attempt stops with its grace, the next starts with it);
- by hand: the user's relaunch, `ssh node torchrun ... &` on each of the nodes left (for "loss")
  and on every node (for "return"), from the command to the first step. It counts none of what
  comes before a person types it: noticing the loss, stopping what is left of the job.
Each repeat runs the three in turn; ratios are taken within a repeat.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import Watched, cluster_args, parallel_ssh_script, spread, torchrun_line
from tests.harness.runner import KILL, REPO, UP, _env
from tests.harness.sshcluster import SSHCluster

TRAIN = str(Path(__file__).resolve().parents[1] / "examples" / "train.py")
STEP = re.compile(r"\| step \d+ loss", re.M)  # a rank's step line, as ddp-up shows it
HAND_STEP = re.compile(r"^step \d+ loss", re.M)  # and as the ssh clients of the relaunch by hand print it


def step_after(watched: Watched, marker: re.Pattern, since: int, timeout: float = 300) -> int:
    """Wait for ``marker`` past offset ``since`` of the output, then for a step line after it;
    the offset just past that step line."""
    found: list[int] = []

    def seen(text: str) -> bool:
        mark = marker.search(text, since)
        step = mark and STEP.search(text, mark.end())
        if step:
            found.append(step.end())
        return bool(step)

    watched.wait_for(seen, timeout)
    return found[-1]


def by_ddp_up(cluster: SSHCluster, path: Path, workdir: Path, n: int, runs: Path) -> tuple[float, float]:
    """(the cut to the smaller run's first step, the restore to the full run's first step), in s."""
    last = cluster.nodes[n - 1]
    ckpt = workdir / f"ckpt-{time.monotonic_ns()}.pt"
    w = Watched([sys.executable, "-c", UP, "--no-dashboard", "--runs-dir", str(runs), str(path), TRAIN,
                 "--steps", "100000", "--step-time", "0.2", "--checkpoint", str(ckpt), "--global-batch", "12"],
                cwd=REPO, env=_env())
    try:
        begun = step_after(w, re.compile(r"\| step 3 loss"), 0)
        cut = time.monotonic()
        cluster.partition(last)
        at = step_after(w, re.compile(rf"resumed after step \d+ at world size {n - 1}$", re.M), begun)
        loss = time.monotonic() - cut
        back = time.monotonic()
        cluster.heal(last)
        step_after(w, re.compile(rf"resumed after step \d+ at world size {n}$", re.M), at)
        grown = time.monotonic() - back
        w.ctrl_c()
        if w.wait(120) is None:
            raise SystemExit(f"ddp-up did not end on Ctrl-C:\n{w.text[-3000:]}")
        return loss, grown
    finally:
        cluster.heal(last)
        w.kill()


def by_hand(cluster: SSHCluster, nodes: list, workdir: Path, port: int) -> float:
    """A cold relaunch typed by hand on ``nodes``: the command to the first step, in s."""
    ckpt = workdir / f"ckpt-hand-{time.monotonic_ns()}.pt"
    args = ["--steps", "3", "--checkpoint", str(ckpt), "--global-batch", "12"]
    script = parallel_ssh_script(cluster, nodes, lambda k: torchrun_line(nodes, k, port, str(workdir), "bench-elastic",
                                                                         args, script=TRAIN))
    start = time.monotonic()
    w = Watched(["bash", "-c", script], env=_env())
    try:
        w.wait_for(lambda text: HAND_STEP.search(text) is not None, 300)
        took = time.monotonic() - start
        if w.wait(120) != 0:
            raise SystemExit(f"the relaunch by hand failed:\n{w.text[-3000:]}")
        return took
    finally:
        w.kill()


def main() -> None:
    args = cluster_args(__doc__, "4")
    with tempfile.TemporaryDirectory(prefix="ddp-up-bench-") as tmp_name:
        tmp = Path(tmp_name)
        for n in args.sizes:
            cluster = SSHCluster(n, tmp / f"cluster{n}")
            cluster.up()
            files = {warm: cluster.cluster_file(tmp / f"{warm}.yaml", [(node, 1) for node in cluster.nodes],
                                                python=sys.executable, workdir=str(tmp), launcher="torchrun",
                                                warm=warm, min_nodes=n - 1, rejoin_after=1, restart_delay=0,
                                                orphan_timeout=3, stop_grace=3, env={"OMP_NUM_THREADS": 1})
                     for warm in (True, False)}
            got: dict[str, list[float]] = {k: [] for k in ("warm loss", "warm return", "cold loss", "cold return",
                                                           "hand smaller", "hand full")}
            try:
                for r in range(args.repeat):
                    for warm in (True, False):
                        loss, grown = by_ddp_up(cluster, files[warm], tmp, n, tmp / "runs")
                        got[f"{'warm' if warm else 'cold'} loss"].append(loss)
                        got[f"{'warm' if warm else 'cold'} return"].append(grown)
                    got["hand smaller"].append(by_hand(cluster, cluster.nodes[:n - 1], tmp, 29400 + 2 * r))
                    got["hand full"].append(by_hand(cluster, cluster.nodes, tmp, 29401 + 2 * r))
                    print(f"{n} nodes, repeat {r}: " + ", ".join(f"{k} {v[-1]:.1f} s" for k, v in got.items()),
                          flush=True)
            finally:
                subprocess.run([sys.executable, "-c", KILL, str(files[True]), "--all", "--purge"], cwd=REPO,
                               env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
                cluster.down()
            print(f"\n{n} nodes, 1 process each, examples/train.py; median (min-max) of {args.repeat}\n")
            print("| | ddp-up warm (s) | ddp-up cold (s) | by hand, cold (s) | warm / by hand | cold / by hand |")
            print("|---|---|---|---|---|---|")
            for what, ours, hand in (("a node lost: to the smaller run's first step", "loss", "hand smaller"),
                                     ("it returns: to the full run's first step", "return", "hand full")):
                ratios = [[o / h for o, h in zip(got[f"{way} {ours}"], got[hand])] for way in ("warm", "cold")]
                print(f"| {what} | {spread(got[f'warm {ours}'])} | {spread(got[f'cold {ours}'])} | "
                      f"{spread(got[hand])} | {spread(ratios[0])} | {spread(ratios[1])} |")
            print(flush=True)


if __name__ == "__main__":
    main()
