"""A small DDP job: verifies an all_reduce across every rank, then trains a tiny model.

Runs on CPU with gloo (or GPU with nccl when CUDA is available), under torchrun as launched by
ddp-up. Exits through os._exit after flushing: torch 2.13 + gloo can abort in interpreter
teardown ("terminate called without an active exception") after a normal exit.
"""

import argparse
import datetime
import os
import sys
import time


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (to watch it run)")
    p.add_argument("--timeout", type=float, default=60.0, help="process-group timeout, seconds")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()

    # Every rank contributes rank+1: the sum must be world*(world+1)/2 everywhere.
    probe = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(probe)
    expected = world * (world + 1) / 2
    if probe.item() != expected:
        print(f"all_reduce mismatch: got {probe.item()}, expected {expected}", file=sys.stderr, flush=True)
        return 1
    print(f"rank {rank}/{world} on {os.uname().nodename}: all_reduce ok ({probe.item():.0f})", flush=True)

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(16, 1).to(device), device_ids=[local_rank] if use_cuda else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        x = torch.randn(32, 16, generator=gen).to(device)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.4f}", flush=True)
        time.sleep(args.step_time)
    dist.barrier(device_ids=[local_rank] if use_cuda else None)  # NCCL: say which GPU is ours
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
