"""A small DDP job: verifies an all_reduce across every rank, then trains a tiny model.

Runs on CPU with gloo (or GPU with nccl when CUDA is available), under torchrun as launched by
ddp-up. Exits through os._exit after flushing: torch 2.13 + gloo can abort in interpreter
teardown ("terminate called without an active exception") after a normal exit.

With --checkpoint FILE it is elastic (docs/guides/elastic.md): rank 0 saves the model, the
optimizer and the step after every step, and a run that finds the file resumes after that step at
whatever world size it now has. The global batch (--global-batch) stays the same at every size,
so the learning rate and the data each step sees do too: a DistributedSampler, its epoch set, and
the steps of the epoch already done skipped.
"""

import argparse
import datetime
import os
import sys
import time


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (to watch it run)")
    p.add_argument("--timeout", type=float, default=60.0, help="process-group timeout, seconds")
    p.add_argument("--checkpoint", help="save to this file after every step, and resume from it")
    p.add_argument("--global-batch", type=int, default=48,
                   help="samples a step over all ranks (a multiple of every world size the job may run at)")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

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
    if args.global_batch % world:
        print(f"--global-batch {args.global_batch} is not a multiple of the world size {world}", file=sys.stderr,
              flush=True)
        return 2

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(16, 1).to(device), device_ids=[local_rank] if use_cuda else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    step = resume(args.checkpoint, model, opt)
    if step and rank == 0:
        print(f"resumed after step {step - 1} at world size {world}", flush=True)

    x = torch.randn(20 * args.global_batch, 16, generator=torch.Generator().manual_seed(0))
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, seed=0)  # this attempt's world
    batches = DataLoader(data, batch_size=args.global_batch // world, sampler=sampler, drop_last=True)
    per_epoch = len(batches)  # the same at every world size: the global batch is
    while step < args.steps:
        sampler.set_epoch(step // per_epoch)  # the same order as an unbroken run's
        for i, (inputs, targets) in enumerate(batches):
            if i < step % per_epoch:
                continue  # done before the restart: the same samples at any world size
            loss = (model(inputs.to(device)) - targets.to(device)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            print(f"step {step} loss {loss.item():.4f}", flush=True)
            step += 1
            if args.checkpoint and rank == 0:
                save(args.checkpoint, model, opt, step)
            time.sleep(args.step_time)
            if step == args.steps:
                break
    dist.barrier(device_ids=[local_rank] if use_cuda else None)  # NCCL: say which GPU is ours
    dist.destroy_process_group()
    return 0


def resume(path, model, opt) -> int:
    """The step to go on from: 0 without a checkpoint."""
    import torch
    if not path or not os.path.exists(path):
        return 0
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.module.load_state_dict(state["model"])  # the same on every rank (DDP): any world size takes it
    opt.load_state_dict(state["optimizer"])
    return int(state["step"])


def save(path, model, opt, step) -> None:
    """Written whole, then renamed over the last: a stop mid-save leaves the last one."""
    import torch
    torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(), "step": step}, path + ".tmp")
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
