"""ddp-fetch at 1 and 4 nodes: a checkpoint folder back from every node, against `rsync -a -e ssh`
and `scp -r` from every node in parallel, in the same run.

    python3 -m benchmarks.fetch [--nodes 1,4] [--repeat 3] [--mb 1024] [--files 256]

On the namespace sshd cluster of the tests (Linux, root; rsync installed). Each node's workdir
holds a checkpoint folder of --files files, --mb MiB in all (random bytes: nothing compresses).
Per repeat and node count:
  first     ddp-fetch into an empty folder, against rsync and scp from every node at once (each
            into a folder of its own, as ddp-fetch's LOCAL_DIR/<node>/)
  again     ddp-fetch with nothing changed (near zero: only the listing crosses)
ddp-fetch runs as a process of its own (Python start-up and imports included), timed like the
baselines with wait4 rusage. Ratios are taken within a repeat.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

from benchmarks.common import cluster_args, spread, timed
from tests.harness.runner import REPO, _env
from tests.harness.sshcluster import SSHCluster

TIMEOUT = 900
FETCH = "from orchestrator.commands.entry import fetch; fetch()"


def make_checkpoint(where: Path, files: int, mb: int) -> None:
    where.mkdir(parents=True)
    size = mb * (1 << 20) // files
    block = os.urandom(1 << 20)
    for i in range(files):
        with open(where / f"shard-{i:05d}.pt", "wb") as f:
            left = size
            while left:
                f.write(block[:min(left, len(block))])
                left -= min(left, len(block))


def ssh_opts(cluster: SSHCluster) -> str:
    return (f"ssh -F none -i {cluster.client_key} -o UserKnownHostsFile={cluster.known_hosts} "
            "-o StrictHostKeyChecking=yes -o BatchMode=yes")


def parallel(commands: list[str]) -> list[str]:
    """One command at once per node; fails if any of them does (a bare `wait` would say 0)."""
    started = "".join(f"({c}) & pids+=($!)\n" for c in commands)
    return ["bash", "-c", f"pids=()\n{started}rc=0\nfor p in \"${{pids[@]}}\"; do wait $p || rc=1; done\nexit $rc"]


def run_size(cluster: SSHCluster, tmp: Path, n: int, repeat: int) -> list[str]:
    nodes = cluster.nodes[:n]
    workdirs = [tmp / "wd" / f"n{k}" for k in range(n)]
    path = cluster.cluster_file(tmp / f"c{n}.yaml", [(node, 1) for node in nodes], python=sys.executable,
                                ssh={"connect_timeout": 30})
    import yaml

    doc = yaml.safe_load(path.read_text())
    for node, wd in zip(doc["nodes"], workdirs):
        node["workdir"] = str(wd)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    out = tmp / "out"
    ssh = ssh_opts(cluster)
    first, rsync, scp, r_ratio, s_ratio, again = [], [], [], [], [], []
    for r in range(repeat):
        shutil.rmtree(out, ignore_errors=True)
        b1 = timed(parallel([f"mkdir -p {out}/rsync/{k} && rsync -a -e {shlex.quote(ssh)} "
                             f"root@{node.addr}:{workdirs[k]}/ckpt {out}/rsync/{k}/" for k, node in enumerate(nodes)]),
                   TIMEOUT)
        b2 = timed(parallel([f"mkdir -p {out}/scp/{k} && scp -q -O -r -F none -i {cluster.client_key} "
                             f"-o UserKnownHostsFile={cluster.known_hosts} -o BatchMode=yes "
                             f"root@{node.addr}:{workdirs[k]}/ckpt {out}/scp/{k}/" for k, node in enumerate(nodes)]),
                   TIMEOUT)
        shutil.rmtree(out / "rsync", ignore_errors=True)
        shutil.rmtree(out / "scp", ignore_errors=True)
        f1 = timed([sys.executable, "-c", FETCH, str(path), "ckpt", str(out / "ddp")], TIMEOUT, cwd=REPO, env=_env())
        f2 = timed([sys.executable, "-c", FETCH, str(path), "ckpt", str(out / "ddp")], TIMEOUT, cwd=REPO, env=_env())
        for sample in (b1, b2, f1, f2):
            if sample.code != 0:
                raise SystemExit(f"failed:\n{sample.output[-3000:]}")
        first.append(f1.wall), rsync.append(b1.wall), scp.append(b2.wall), again.append(f2.wall)
        r_ratio.append(f1.wall / b1.wall), s_ratio.append(f1.wall / b2.wall)
        print(f"nodes={n} repeat={r}: ddp-fetch {f1.wall:.2f} s, rsync {b1.wall:.2f} s, scp {b2.wall:.2f} s, "
              f"again {f2.wall:.2f} s", flush=True)
    shutil.rmtree(out, ignore_errors=True)
    return [str(n), spread(first), spread(rsync), spread(r_ratio), spread(scp), spread(s_ratio), spread(again)]


def main() -> None:
    def size(p) -> None:
        p.add_argument("--mb", type=int, default=1024)
        p.add_argument("--files", type=int, default=256)

    args = cluster_args(__doc__, "1,4", size)
    if not shutil.which("rsync"):
        raise SystemExit("needs rsync (apt-get install rsync)")
    with tempfile.TemporaryDirectory(prefix="ddp-up-bench-") as tmp_name:
        tmp = Path(tmp_name)
        for k in range(max(args.sizes)):
            make_checkpoint(tmp / "wd" / f"n{k}" / "ckpt", args.files, args.mb)
        cluster = SSHCluster(max(args.sizes), tmp / "cluster")
        cluster.up()
        try:
            rows = [run_size(cluster, tmp, n, args.repeat) for n in args.sizes]
        finally:
            cluster.down()
    print(f"\na checkpoint folder of {args.files} files, {args.mb} MiB, from each node; median (min-max) of "
          f"{args.repeat}, seconds\n")
    print("| nodes | ddp-fetch first | rsync -a -e ssh | ratio | scp -r | ratio | ddp-fetch again (no change) |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
