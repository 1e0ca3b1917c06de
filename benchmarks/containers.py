"""Container cost: what does ddp-up add to a job that runs in an image?

    python3 -m benchmarks.containers [--repeat 5] [--runtime podman|docker] [--ranks 1] [--restart]

Two `transport: local` nodes, `--ranks` ranks each, a gloo all-reduce (torch imported in each
rank): the test image of tests/harness/podman.py (an empty root filesystem, the test's Python
bind-mounted read-only). Four ways, interleaved in each repeat:
  hand     the baseline: the two `RUNTIME run ... torchrun` lines a user types, started together
  ddp-up   the same job through ddp-up with `container:` (preflight, the versions read from the
           image once and kept, the containers named, watched and removed), warm start (the
           default under torchrun: the image's interpreter imports torch once, the ranks are forked)
  cold     the same with `warm: false`: torchrun and each rank import torch
  host     the same job through ddp-up without a container, for reference
Prints each way's median wall time and its ratio to the baseline; the first ddp-up run reads the
image's versions in a container of its own (later ones find them kept), shown on its own row.

With --restart, a restart in containers instead (tests/scripts/job.py, rank 1 failing in attempt 0,
`restarts: 1`, `restart_delay: 1`), alternating in each repeat: a fresh launch, to its first line
(what a restart in a container cost when each attempt started a container of its own: a container's
start, then torch imported in it), and the restart, from the failure to attempt 1's first line less
the delay (the attempt forked in each node's kept container, node/launchers/keptbox.py).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.common import SCRIPT, Watched
from benchmarks.restart import failure_to_restart, first_line
from tests.harness.podman import IMAGE, Docker, Podman, available, docker_available
from tests.harness.runner import REPO, UP, _env

DELAY = 1.0  # restart_delay of --restart

TRAIN = """\
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == dist.get_world_size()
dist.destroy_process_group()
"""


def by_hand(store, work: Path, port: int, ranks: int) -> float:
    """The baseline: each node's container started by hand, both at once."""
    conf = store.config()
    mounts = [f"--volume={m}" for m in conf["mounts"]] + [f"--volume={work}:{work}"]
    lines = [[store.runtime, "run", "--rm", "--network=host", "--ipc=host", *mounts, f"--workdir={work}", IMAGE,
              conf["python"], "-m", "torch.distributed.run", "--nnodes=2", f"--nproc-per-node={ranks}", f"--node-rank={rank}",
              "--master-addr=127.0.0.1", f"--master-port={port}", "train.py"] for rank in (0, 1)]
    start = time.monotonic()
    procs = [subprocess.Popen(line, env={**_env(), **store.env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for line in lines]
    codes = [p.wait(300) for p in procs]
    assert codes == [0, 0], f"the hand-written containers failed: {codes}"
    return time.monotonic() - start


def through_ddp_up(store, cluster: Path, runs: Path) -> float:
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", UP, "--runs-dir", str(runs), "--no-dashboard", str(cluster), "train.py"],
                          cwd=cluster.parent, env={**_env(), "PYTHONPATH": str(REPO), **store.env},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]
    return time.monotonic() - start


def cluster_file(work: Path, name: str, container: dict | None, ranks: int, **keys) -> Path:
    data = {"transport": "local", "python": sys.executable, "workdir": str(work), "env": {"OMP_NUM_THREADS": 1},
            "nodes": [{"host": f"local-{i}", "gpus": ranks} for i in range(2)], **keys}
    if container:
        data["container"] = container
    path = work / name
    path.write_text(yaml.safe_dump(data))
    return path


def timed_restart(store, cluster: Path, runs: Path, restarts: bool) -> float:
    """--restart: from the failure to attempt 1's first line, less the delay; or, with ``restarts``
    false, a fresh launch to its first line."""
    fails = ["--restarts", "1"] if restarts else []
    argv = [sys.executable, "-c", UP, "--runs-dir", str(runs), "--no-dashboard", *fails, str(cluster), Path(SCRIPT).name,
            "run", "--steps", "0", *(["--fail-rank", "1", "--fail-attempts", "0"] if restarts else [])]
    start = time.monotonic()
    w = Watched(argv, cwd=cluster.parent, env={**_env(), "PYTHONPATH": str(REPO), **store.env})
    if restarts:
        return failure_to_restart(w, DELAY, "the restart in containers")
    return first_line(w, start, "the launch in containers")


def restarts_in_containers(store, work: Path, runs: Path, repeat: int, ranks: int) -> None:
    shutil.copy(SCRIPT, work)
    cluster = cluster_file(work, "restart.yaml", store.config(), ranks, restart_delay=DELAY)
    times: dict[str, list[float]] = {"fresh": [], "restart": []}
    timed_restart(store, cluster, runs, False)  # reads the versions from the image: kept
    for r in range(repeat):
        for way in (("fresh", "restart") if r % 2 == 0 else ("restart", "fresh")):
            times[way].append(timed_restart(store, cluster, runs, way == "restart"))
    fresh, again = statistics.median(times["fresh"]), statistics.median(times["restart"])
    print(f"{store.runtime}, 2 local nodes x {ranks} rank(s), {repeat} repeats (median seconds, range)")
    print(f"fresh launch in containers, to its first line      {fresh:6.2f}  ({min(times['fresh']):.2f}-{max(times['fresh']):.2f})")
    print(f"restart, failure to attempt 1's first line - delay {again:6.2f}  "
          f"({min(times['restart']):.2f}-{max(times['restart']):.2f})  {again / fresh:.2f} of the fresh launch")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--runtime", choices=("podman", "docker"), default="podman")
    ap.add_argument("--ranks", type=int, default=1, help="ranks per node")
    ap.add_argument("--restart", action="store_true", help="time a restart in containers instead")
    args = ap.parse_args()
    why = available() or (docker_available() if args.runtime == "docker" else None)
    if why:
        print(f"cannot run: {why}")
        return 2
    with tempfile.TemporaryDirectory(prefix="ddp-up-bench-") as tmp:
        root = Path(tmp)
        (root / "store").mkdir()
        (root / "work").mkdir()
        (root / "tmp").mkdir()
        work = root / "work"
        (work / "train.py").write_text(TRAIN)
        store = (Docker if args.runtime == "docker" else Podman)(root / "store", root / "tmp").up()
        if args.restart:
            try:
                restarts_in_containers(store, work, root / "runs", args.repeat, args.ranks)
                print(f"containers left after the runs: {len(store.containers())}")
            finally:
                store.down()
            return 0
        try:
            files = {"ddp-up": cluster_file(work, "boxed.yaml", store.config(), args.ranks),
                     "cold": cluster_file(work, "cold.yaml", store.config(), args.ranks, warm=False),
                     "host": cluster_file(work, "host.yaml", None, args.ranks)}
            times: dict[str, list[float]] = {"hand": [], **{way: [] for way in files}}
            first = through_ddp_up(store, files["ddp-up"], root / "runs")  # reads the versions from the image: kept
            for i in range(args.repeat):
                times["hand"].append(by_hand(store, work, 29400 + i, args.ranks))
                for way, cluster in files.items():
                    times[way].append(through_ddp_up(store, cluster, root / "runs"))
            left = store.containers()
        finally:
            store.down()
    base = statistics.median(times["hand"])
    print(f"{args.runtime}, 2 local nodes x {args.ranks} rank(s), gloo all-reduce, {args.repeat} repeats (median wall time)")
    print(f"{'way':<28} {'seconds':>8} {'vs hand':>8}")
    rows = [("hand (2 x `run` by hand)", base), ("ddp-up, container, warm", statistics.median(times["ddp-up"])),
            ("ddp-up, container, 1st run", first), ("ddp-up, container, cold", statistics.median(times["cold"])),
            ("ddp-up, host (no container)", statistics.median(times["host"]))]
    for name, seconds in rows:
        print(f"{name:<28} {seconds:>8.2f} {seconds / base:>8.2f}")
    print(f"containers left after the runs: {len(left)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
