"""Inside a 3-node Slurm allocation: ddp-up --slurm against the Slurm helper script people write.

    python3 -m benchmarks.slurm [--repeat 5]

On the Slurm test cluster (tests/harness/slurmcluster.py: real slurmctld and slurmds in network
namespaces), launch to exit of a trivial torch job (init_process_group, one all_reduce, barrier;
gloo): `ddp-up --slurm` (srun steps, preflight, relay) against the by-hand way, one
`srun -N3 --ntasks-per-node=1 bash -c 'torchrun --node-rank=$SLURM_NODEID ...'` with the
rendezvous variables filled in. Both run in one `salloc -N3` each, so both pay the allocation;
the two alternate in each repeat and ratios are taken within a repeat.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from benchmarks.common import JOB_ENV, SCRIPT, compile_like_pip, spread, timed
from tests.harness.runner import REPO, UP, _env
from tests.harness.slurmcluster import SlurmCluster, available

JOB = ["run", "--steps", "0"]
NODES = 3


def by_hand(port: int) -> str:
    """What a Slurm helper script does: the master is the first node, the node rank is SLURM_NODEID."""
    env = " ".join(f"{k}={v}" for k, v in JOB_ENV.items())
    torchrun = (f"env {env} {sys.executable} -u -m torch.distributed.run --nnodes={NODES} --nproc-per-node=1 "
                f"--node-rank=$SLURM_NODEID --master-addr=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -1) "
                f"--master-port={port} {SCRIPT} {' '.join(JOB)}")
    return f"srun -N{NODES} --ntasks-per-node=1 bash -c '{torchrun}'"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    if reason := available():
        sys.exit(f"cannot run: {reason}")
    compile_like_pip()
    with tempfile.TemporaryDirectory(prefix="ddp-up-bench-") as tmp_name:
        tmp = Path(tmp_name)
        settings = tmp / "settings.yaml"
        settings.write_text(f"python: {sys.executable}\nworkdir: {tmp}\nenv: {{OMP_NUM_THREADS: 1}}\n")
        cluster = SlurmCluster(NODES, tmp / "cluster")
        cluster.up()
        env = {**_env(), "SLURM_CONF": cluster.env["SLURM_CONF"]}
        salloc = ["salloc", f"-N{NODES}", "--ntasks-per-node=1", "--quiet"]
        ours, theirs, ratios = [], [], []
        try:
            for r in range(args.repeat):
                got = {}
                for way in (("ddp-up", "srun") if r % 2 == 0 else ("srun", "ddp-up")):
                    argv = salloc + ([sys.executable, "-c", UP, "--slurm", "--no-dashboard", "--runs-dir",
                                      str(tmp / "runs"), str(settings), SCRIPT, *JOB] if way == "ddp-up"
                                     else ["bash", "-c", by_hand(29500 + r)])
                    sample = timed(argv, 300, cwd=REPO, env=env)
                    if sample.code != 0:
                        raise SystemExit(f"{way} failed:\n{sample.output[-3000:]}")
                    got[way] = sample.wall
                ours.append(got["ddp-up"]), theirs.append(got["srun"]), ratios.append(got["ddp-up"] / got["srun"])
                print(f"repeat {r}: ddp-up {got['ddp-up']:.2f} s, srun + torchrun by hand {got['srun']:.2f} s",
                      flush=True)
        finally:
            cluster.down()
    print(f"\n{NODES} nodes in one allocation, 1 rank each, a trivial gloo job; median (min-max) of {args.repeat}\n")
    print("| ddp-up --slurm (s) | srun -N3 torchrun by hand (s) | ratio |")
    print("|---|---|---|")
    print(f"| {spread(ours)} | {spread(theirs)} | {spread(ratios)} |")


if __name__ == "__main__":
    main()
