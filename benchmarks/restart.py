"""How fast a restart is: from a failure to the next attempt's first line, against a fresh launch.

    python3 -m benchmarks.restart [--nodes 4] [--repeat 5] [--delay 1] [--warm]

On the namespace SSH cluster, one process per node, a trivial gloo job (job.py run --steps 0):
- fresh: `ddp-up` started to the first READY line of any rank;
- restart: `ddp-up` with `restarts: 1`, `restart_delay: --delay`, where rank 1 fails in attempt 0
  just after READY; from its failure line to the first READY line of attempt 1, less the delay;
- detached: the same with `--detach` (the job's own agents restart it), timed by the wall-clock
  times its ranks print on those two lines (job.py's $JOB_TIMES), read from a `ddp-attach` started
  as soon as `--detach` returns: the attach may replay them both at once.
The target: restart - delay <= 1.2 x fresh. The three alternate in each repeat; ratios within one.
With --warm, the two restarts are timed again with `warm: true` (each attempt's ranks forked from
an interpreter that imported torch), alternating with the cold ones; ratios warm / cold.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import SCRIPT, Watched, cluster_args, spread
from tests.harness.runner import KILL, REPO, UP, _env

ATTACH = "from orchestrator.commands.entry import attach; attach()"
FAILING = [SCRIPT, "run", "--steps", "0", "--fail-rank", "1", "--fail-attempts", "0"]
from tests.harness.sshcluster import SSHCluster


def first_line_after(watched: Watched, marker: str, start: float) -> float:
    watched.wait_for(lambda text: marker in text, 180)
    return time.monotonic() - start


def fresh(cluster_yaml: Path, runs: Path) -> float:
    start = time.monotonic()
    w = Watched([sys.executable, "-c", UP, "--no-dashboard", "--runs-dir", str(runs), str(cluster_yaml), SCRIPT,
                 "run", "--steps", "0"], cwd=REPO, env=_env())
    return first_line(w, start, "fresh launch")


def first_line(w: Watched, start: float, what: str) -> float:
    """Seconds from ``start`` to the first rank's first line of the run ``w``, which must succeed."""
    try:
        took = first_line_after(w, "READY rank=", start)
        if w.wait(120) != 0:
            raise SystemExit(f"{what} failed:\n{w.text[-3000:]}")
        return took
    finally:
        w.kill()


def restart(cluster_yaml: Path, runs: Path, delay: float) -> float:
    w = Watched([sys.executable, "-c", UP, "--no-dashboard", "--runs-dir", str(runs), "--restarts", "1",
                 str(cluster_yaml), *FAILING], cwd=REPO, env=_env())
    return failure_to_restart(w, delay, "restarted run")


def detached(cluster_yaml: Path, runs: Path, delay: float) -> float:
    up = subprocess.run([sys.executable, "-c", UP, "--detach", "--restarts", "1", "--runs-dir", str(runs),
                         str(cluster_yaml), *FAILING], cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True, timeout=180)
    found = re.search(r"job (\S+) runs detached", up.stdout)
    if up.returncode != 0 or not found:
        raise SystemExit(f"--detach failed:\n{up.stdout[-3000:]}")
    w = Watched([sys.executable, "-c", ATTACH, "--no-dashboard", "--runs-dir", str(runs), str(cluster_yaml),
                 found.group(1)], cwd=REPO, env=_env())
    try:  # timed by when the lines were printed ($JOB_TIMES): the attach, started after --detach returned,
        # may be shown both at once, replayed (a warm restart can be over before it starts)
        if w.wait(180) != 0:
            raise SystemExit(f"detached job failed:\n{w.text[-3000:]}")
    finally:
        w.kill()
    failed = re.search(r"rank 1 failing with \d+ t=([\d.]+)", w.text)
    ready = re.search(r"READY rank=\d+ .* attempt=1 t=([\d.]+)", w.text)
    if not failed or not ready:
        raise SystemExit(f"detached job: no timed failure or restart line:\n{w.text[-3000:]}")
    return float(ready.group(1)) - float(failed.group(1)) - delay


def failure_to_restart(w: Watched, delay: float, what: str) -> float:
    try:
        w.wait_for(lambda text: "rank 1 failing with" in text, 180)
        failed = time.monotonic()
        took = first_line_after(w, "attempt=1", failed) - delay
        if w.wait(120) != 0:
            raise SystemExit(f"{what} failed:\n{w.text[-3000:]}")
        return took
    finally:
        w.kill()


def main() -> None:
    def more(p):
        p.add_argument("--delay", type=float, default=1.0)
        p.add_argument("--warm", action="store_true", help="time the restarts warm too (warm: true)")
    args = cluster_args(__doc__, "4", more)
    with tempfile.TemporaryDirectory(prefix="ddp-up-bench-") as tmp_name:
        tmp = Path(tmp_name)
        for n in args.sizes:
            cluster = SSHCluster(n, tmp / f"cluster{n}")
            cluster.up()
            try:
                path, warm = (cluster.cluster_file(tmp / name, [(node, 1) for node in cluster.nodes],
                                                   python=sys.executable, workdir=str(tmp), restart_delay=args.delay,
                                                   env={"OMP_NUM_THREADS": 1, "JOB_TIMES": 1}, warm=is_warm)
                              for name, is_warm in (("cluster.yaml", False), ("warm.yaml", True)))
                ways = {"fresh": fresh, "restart": lambda p, runs: restart(p, runs, args.delay),
                        "detached": lambda p, runs: detached(p, runs, args.delay)}
                if args.warm:
                    ways.update({"restart warm": lambda p, runs: restart(warm, runs, args.delay),
                                 "detached warm": lambda p, runs: detached(warm, runs, args.delay)})
                got = {way: [] for way in ways}
                for r in range(args.repeat):
                    order = list(ways)[r % len(ways):] + list(ways)[:r % len(ways)]
                    for way in order:
                        got[way].append(ways[way](path, tmp / "runs"))
                    print(f"{n} nodes, repeat {r}: fresh launch to first line {got['fresh'][-1]:.2f} s; failure to "
                          f"attempt 1's first line less the delay {got['restart'][-1]:.2f} s, detached "
                          f"{got['detached'][-1]:.2f} s", flush=True)
            finally:
                subprocess.run([sys.executable, "-c", KILL, str(path), "--all", "--purge"], cwd=REPO, env=_env(),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
                cluster.down()
            ratios = {way: [t / f for t, f in zip(got[way], got["fresh"])] for way in ("restart", "detached")}
            print(f"\n{n} nodes, 1 process each, restart_delay {args.delay:g} s; median (min-max) of {args.repeat}\n")
            print("| fresh launch to first line (s) | failure to next attempt's first line - delay (s) | ratio "
                  "| the same, detached (s) | ratio |")
            print("|---|---|---|---|---|")
            print(f"| {spread(got['fresh'])} | {spread(got['restart'])} | {spread(ratios['restart'])} "
                  f"| {spread(got['detached'])} | {spread(ratios['detached'])} |\n", flush=True)
            if args.warm:
                print("| | cold (s) | warm (s) | warm / cold |\n|---|---|---|---|")
                for way in ("restart", "detached"):
                    pairs = [w / c for w, c in zip(got[f"{way} warm"], got[way])]
                    print(f"| {way} | {spread(got[way])} | {spread(got[f'{way} warm'])} | {spread(pairs)} |")
                print(flush=True)


if __name__ == "__main__":
    main()
