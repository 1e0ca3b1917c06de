"""Workdir sync at 1..16 nodes: ddp-up's copy against the manual way (parallel `tar | ssh tar -x`).

    python3 -m benchmarks.sync [--nodes 1,4,16] [--repeat 3] [--files 1000] [--big-mb 32]

On the namespace sshd cluster of the tests (Linux, root). The tree is a project as users have
one: --files source files of 1-8 KB in 40 directories, one --big-mb file (an asset or a small
checkpoint), and a 64 MB data/ directory that .gitignore excludes. Each node gets its own
destination (the namespaces share this machine's disk). Per repeat and node count:
  first     ddp-up's copy into empty workdirs, against `tar --exclude-vcs-ignores -c . | ssh node
            'tar -x'` per node in parallel (which honours .gitignore too; rsync is not installed
            here, and tar is what people script when it is not)
  again     ddp-up with nothing changed (tar would copy everything again: its time is `first`)
  one       ddp-up after one source file changed
ddp-up runs as a process of its own (Python start-up and imports included), timed like the
baseline with wait4 rusage. Ratios are taken within a repeat.
"""

from __future__ import annotations

import os
import random
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

from benchmarks.common import cluster_args, parallel_ssh_script, spread, timed
from tests.harness.runner import REPO, _env
from tests.harness.sshcluster import SSHCluster

TIMEOUT = 600
DRIVER = """
import sys
from rich.console import Console
from orchestrator.config.clusterfile import load_cluster
from orchestrator.plan.launch import make_plan
from orchestrator.commands.common import ssh_connections
from orchestrator.commands.up import copy_workdirs
config = load_cluster(sys.argv[1])
plan = make_plan(config, "job.py", [], "bench", "/")
with ssh_connections():  # as ddp-up does: the run's ssh masters end with it
    copy_workdirs(plan, config.sync, "/nonexistent/runs", config.path, Console())
"""

def make_tree(src: Path, files: int, big_mb: int) -> None:
    rng = random.Random(7)
    src.mkdir(parents=True)
    for i in range(files):
        path = src / f"pkg{i % 40}" / f"mod{i}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(rng.randint(1024, 8192)))
    (src / "assets").mkdir()
    (src / "assets" / "weights.bin").write_bytes(os.urandom(big_mb * 1_000_000))
    (src / "data").mkdir()
    for i in range(4):
        (src / "data" / f"shard{i}.bin").write_bytes(os.urandom(16_000_000))
    (src / ".gitignore").write_text("data/\n*.pyc\n")
    (src / "README.md").write_text("# project\n")


def cluster_file(cluster: SSHCluster, tmp: Path, n: int, src: Path, dests: list[Path]) -> Path:
    import yaml

    path = cluster.cluster_file(tmp / f"c{n}.yaml", [(node, 1) for node in cluster.nodes[:n]],
                                python=sys.executable, sync=str(src), ssh={"connect_timeout": 30})
    doc = yaml.safe_load(path.read_text())
    for node, dest in zip(doc["nodes"], dests):
        node["workdir"] = str(dest)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def fresh(dests: list[Path]) -> None:
    for d in dests:
        shutil.rmtree(d, ignore_errors=True)


def ddp_up_sync(path: Path):
    sample = timed([sys.executable, "-c", DRIVER, str(path)], TIMEOUT, cwd=REPO, env=_env())
    if sample.code != 0:
        raise SystemExit(f"ddp-up sync failed:\n{sample.output[-3000:]}")
    return sample


def tar_ssh(cluster: SSHCluster, n: int, src: Path, dests: list[Path]):
    tar = f"tar --exclude-vcs --exclude-vcs-ignores -C {shlex.quote(str(src))} -cf - ."
    script = parallel_ssh_script(cluster, cluster.nodes[:n],
                                 lambda k: f"mkdir -p {shlex.quote(str(dests[k]))} && tar -C {shlex.quote(str(dests[k]))} -xf -",
                                 feed=tar)  # every ssh reads its own tar stream
    sample = timed(["bash", "-c", script], TIMEOUT)
    if sample.code != 0:
        raise SystemExit(f"tar | ssh failed:\n{sample.output[-3000:]}")
    return sample


def main() -> None:
    def tree_size(p) -> None:
        p.add_argument("--files", type=int, default=1000)
        p.add_argument("--big-mb", type=int, default=32)

    args = cluster_args(__doc__, "1,4,16", tree_size)
    with tempfile.TemporaryDirectory(prefix="ddp-up-bench-") as tmp_name:
        tmp = Path(tmp_name)
        src = tmp / "src"
        make_tree(src, args.files, args.big_mb)
        cluster = SSHCluster(max(args.sizes), tmp / "cluster")
        cluster.up()
        try:
            rows = [run_size(cluster, tmp, n, src, args.repeat) for n in args.sizes]
        finally:
            cluster.down()
    print(f"\ntree: {args.files} files of 1-8 KB + one {args.big_mb} MB file (+ 64 MB .gitignore'd); "
          f"median (min-max) of {args.repeat}, seconds\n")
    print("| nodes | ddp-up first | tar \\| ssh first | ratio | ddp-up again (no change) | ddp-up one changed | "
          "ddp-up CPU first |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


def run_size(cluster: SSHCluster, tmp: Path, n: int, src: Path, repeat: int) -> list[str]:
    dests = [tmp / "dest" / f"n{n}-{k}" for k in range(n)]
    path = cluster_file(cluster, tmp, n, src, dests)
    first, baseline, ratio, again, one, cpu = [], [], [], [], [], []
    for r in range(repeat):
        fresh(dests)
        b = tar_ssh(cluster, n, src, dests)
        fresh(dests)
        s = ddp_up_sync(path)
        assert "copied" in s.output, s.output
        a = ddp_up_sync(path)
        assert "nothing to copy" in a.output, a.output
        (src / "README.md").write_text(f"# project, edit {r}\n")
        o = ddp_up_sync(path)
        assert "copied 1 file(s)" in o.output, o.output
        first.append(s.wall), baseline.append(b.wall), ratio.append(s.wall / b.wall)
        again.append(a.wall), one.append(o.wall), cpu.append(s.cpu)
        print(f"nodes={n} repeat={r}: ddp-up {s.wall:.2f} s, tar|ssh {b.wall:.2f} s, again {a.wall:.2f} s, "
              f"one {o.wall:.2f} s", flush=True)
    fresh(dests)
    return [str(n), spread(first), spread(baseline), spread(ratio), spread(again), spread(one), spread(cpu)]


if __name__ == "__main__":
    main()
