"""What recording every collective costs a job: the Flight Recorder on (ddp-up's default: the
buffer, and the thread that writes each rank's record) against off, interleaved in one run.

    python3 -m benchmarks.flight [--repeat 5] [--seconds 4] [--size 256] [--every 5]

Each run is torchrun with 2 ranks (gloo on CPU) doing back-to-back all_reduces of ``--size``
float32 elements for ``--seconds``: the smallest collectives, so the per-collective cost of
recording is as large a share as it can be. "on" is the environment and the sitecustomize hook
the agent gives a job (node/watch/flight.py), with the records written every ``--every`` seconds (the
default is ddp-up's; a smaller one shows the writing's cost, magnified). Steps per second of
rank 0, medians with min-max, and the ratio on/off.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

from orchestrator.node.watch import flight
from orchestrator.node.watch.stacks import hooks

LOOP = r"""
import os, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
x, seconds = torch.ones(int(sys.argv[1])), float(sys.argv[2])
for _ in range(200):
    dist.all_reduce(x)
dist.barrier()
steps, start = 0, time.perf_counter()
while True:
    for _ in range(50):
        dist.all_reduce(x)
    steps += 50
    done = torch.tensor([float(time.perf_counter() - start >= seconds)])
    dist.all_reduce(done, op=dist.ReduceOp.MAX)  # every rank stops at the same step
    steps += 1
    if done.item():
        break
if dist.get_rank() == 0:
    print("STEPS_PER_S %.1f" % (steps / (time.perf_counter() - start)), flush=True)
dist.destroy_process_group()
os._exit(0)
"""


def one_run(on: bool, args: argparse.Namespace, work: str) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_FR_BUFFER_SIZE": "0", "TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}
    if on:
        for var in flight.BUFFER_VARS:
            env.pop(var)
        records = tempfile.mkdtemp(dir=work)
        flight.recording_env(env, records)
        env[flight.EVERY_VAR] = str(args.every)
        env["PYTHONPATH"] = os.path.join(work, "hook")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          os.path.join(work, "loop.py"), str(args.size), str(args.seconds)],
                         env=env, capture_output=True, text=True, timeout=args.seconds * 10 + 60)
    m = re.search(r"STEPS_PER_S ([\d.]+)", out.stdout)
    if m is None:
        raise SystemExit(f"the loop failed:\n{out.stdout}\n{out.stderr}")
    if on and not os.listdir(records) and args.seconds > args.every:
        raise SystemExit("the recorder wrote no record: the 'on' runs did not measure it")
    return float(m.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--every", type=float, default=flight.RECORD_EVERY)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        os.mkdir(os.path.join(work, "hook"))
        for name, text in hooks(False).items():  # the rank hook, its recorder on where the job records
            with open(os.path.join(work, "hook", name), "w") as f:
                f.write(text)
        with open(os.path.join(work, "loop.py"), "w") as f:
            f.write(LOOP)
        runs: dict[str, list[float]] = {"off": [], "on": []}
        for _ in range(args.repeat):
            for name in ("off", "on"):  # interleaved: the machine's drift touches both alike
                runs[name].append(one_run(name == "on", args, work))
    print(f"all_reduce of {args.size} float32, 2 ranks, gloo on CPU, {args.seconds:g} s a run, "
          f"{args.repeat} runs each; records every {args.every:g} s")
    print(f"{'':<5} {'steps/s (median)':>17} {'min-max':>17}")
    for name, values in runs.items():
        print(f"{name:<5} {statistics.median(values):>17.0f} {min(values):>8.0f}-{max(values):<8.0f}")
    ratio = statistics.median(runs["on"]) / statistics.median(runs["off"])
    print(f"on/off: {ratio:.3f} (cost {(1 - ratio) * 100:+.1f}%)")


if __name__ == "__main__":
    main()
