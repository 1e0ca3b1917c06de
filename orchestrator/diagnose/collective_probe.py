"""ddp-check --collective's program: run on the nodes under torchrun, one process per node.

Never imported by the controller (it needs torch): ddp-check ships its text in the run spec,
each agent writes it into the node's private state directory, and torchrun runs it with -m.

What it measures, every figure timed where it happens and gathered to rank 0, which prints one
line, ``DDP_UP_COLLECTIVE <json>``:
- all_reduce at a few sizes (the median of a few rounds; a size is skipped once the one before
  says it would take too long, so one slow link cannot stretch the check past a minute);
- each directed link from node r to node r+s, for strides s = 1 and 2, all links of a stride at
  once (a ring): node r+s times its receive of LINK_BYTES from node r. Two strides give every
  node two partners each way, so a slow node shows as slow both times, and its partners do not;
- each node's pace at ARRIVAL_ROUNDS small all_reduces, each after the same short pause: how
  long after the previous one ended (its own monotonic clock: no skew between nodes) it called
  the next. A node that comes late to most of them is a straggler (stragglers.py's words).
"""

import datetime
import json
import os
import statistics
import sys
import time

WARM = "torch" in sys.modules  # imported before this module ran: forked from the node's warm interpreter

import torch  # noqa: E402 - after the look at what was imported before
import torch.distributed as dist

SIZES = [int(s) for s in os.environ.get("DDP_UP_COLLECTIVE_SIZES", "65536,1048576,16777216").split(",")]
LINK_BYTES = int(os.environ.get("DDP_UP_COLLECTIVE_LINK_BYTES", str(4 << 20)))
ROUNDS = 3
SIZE_BUDGET = 5.0  # seconds one size may take in all; a bigger size is skipped past that
PING_ROUNDS = 10
LINK_ROUNDS = 3  # each link's best is kept: noise only ever slows a transfer down
ARRIVAL_ROUNDS = 20
ARRIVAL_PAUSE = 0.01  # seconds of "work" before each of those all_reduces, the same on every node


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def agreed_max(value, device):
    """The largest of every rank's ``value``: the same number everywhere, so every rank takes
    the same decision from it."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def time_all_reduce(size, device):
    x = torch.ones(max(1, size // 4), dtype=torch.float32, device=device)
    dist.all_reduce(x)  # warm-up: connections, buffers
    sync(device)
    times = []
    for _ in range(ROUNDS):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(x)
        sync(device)
        times.append(agreed_max(time.perf_counter() - start, device))
    return statistics.median(times)


def all_reduces(device):
    """[[bytes, seconds or None (skipped)]] for each size."""
    results, last = [], None
    for size in SIZES:
        if last is not None and last[1] * (size / last[0]) * (ROUNDS + 1) > SIZE_BUDGET:
            results.append([size, None])
            continue
        seconds = time_all_reduce(size, device)
        results.append([size, seconds])
        last = (size, seconds)
    return results


def exchange(rank, world, stride, x, y, device):
    """Send ``x`` to rank+stride while receiving ``y`` from rank-stride; the seconds the receive
    took, from a common start."""
    dist.barrier()
    sync(device)
    start = time.perf_counter()
    # one batch: NCCL needs a ring's sends and receives posted together, or they wait on each other
    recv, send = dist.batch_isend_irecv([dist.P2POp(dist.irecv, y, (rank - stride) % world),
                                         dist.P2POp(dist.isend, x, (rank + stride) % world)])
    recv.wait()
    sync(device)
    took = time.perf_counter() - start
    send.wait()
    return took


def links(rank, world, device):
    """[[src, dst, bytes, seconds, latency seconds]] of the links this rank received on."""
    strides = [1, 2] if world > 2 else [1] if world == 2 else []
    small = torch.ones(1, device=device), torch.zeros(1, device=device)
    big = torch.ones(max(1, LINK_BYTES // 4), device=device), torch.zeros(max(1, LINK_BYTES // 4), device=device)
    pings = {stride: [exchange(rank, world, stride, *small, device) for _ in range(PING_ROUNDS)]  # and a warm-up
             for stride in strides}
    best = dict.fromkeys(strides, float("inf"))
    for _ in range(LINK_ROUNDS):  # the strides take turns: a moment of noise (a busy core) spoils one round, not all
        for stride in strides:
            best[stride] = min(best[stride], exchange(rank, world, stride, *big, device))
    return [[(rank - stride) % world, rank, LINK_BYTES, best[stride], statistics.median(pings[stride])]
            for stride in strides]


def arrivals(device):
    """[seconds from the end of one small all_reduce to the call of the next] on this node."""
    t, found = torch.ones(1, device=device), []
    dist.all_reduce(t)
    sync(device)
    for _ in range(ARRIVAL_ROUNDS):
        ended = time.perf_counter()
        time.sleep(ARRIVAL_PAUSE)
        found.append(time.perf_counter() - ended)
        dist.all_reduce(t)
        sync(device)
    return found


def main():
    backend = "nccl" if torch.cuda.is_available() and os.environ.get("DDP_UP_COLLECTIVE_BACKEND") != "gloo" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    started = time.perf_counter()
    reduce_times = all_reduces(device)
    mine = {"rank": rank, "host": os.uname().nodename, "links": links(rank, world, device),
            "arrivals": arrivals(device), "warm": WARM}
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        report = {"backend": backend, "world": world, "all_reduce": reduce_times,
                  "links": [link for g in gathered for link in g["links"]],
                  "hosts": [g["host"] for g in sorted(gathered, key=lambda g: g["rank"])],
                  "arrivals": [g["arrivals"] for g in sorted(gathered, key=lambda g: g["rank"])],
                  "warm": sum(1 for g in gathered if g["warm"]),
                  "seconds": time.perf_counter() - started}
        print("DDP_UP_COLLECTIVE " + json.dumps(report), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo can abort in interpreter teardown; everything is said


if __name__ == "__main__":
    main()
