"""An Accelerate script as its users write them: `Accelerator()`, `prepare`, a tqdm bar on the
main process, `save_state` every epoch, and `load_state` from the latest when the job is started
again (ddp-up's `restarts:` does that after a failure). Run it with `launcher: accelerate` (or
under torchrun with ACCELERATE_USE_CPU=1 on nodes without GPUs).

    ddp-up cluster.yaml examples/accelerate_train.py --out ckpt-acc --epochs 3

--fail-epoch N makes process --fail-rank raise in epoch N of the first attempt only
(DDP_UP_ATTEMPT); --kill makes it die of SIGKILL instead.
"""

import argparse
import json
import os
import signal
import sys

import torch
from accelerate import Accelerator
from tqdm.auto import tqdm


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="ckpt-acc")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--fail-epoch", type=int, default=-1)
    p.add_argument("--fail-rank", type=int, default=1)
    p.add_argument("--kill", action="store_true")
    args = p.parse_args()
    accelerator = Accelerator()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer, loader = accelerator.prepare(model, optimizer, torch.utils.data.DataLoader(data, batch_size=16))
    done = os.path.join(args.out, "epoch.json")
    first = 0
    if os.path.exists(done):
        accelerator.load_state(args.out)
        with open(done) as f:
            first = json.load(f)["epoch"] + 1
        accelerator.print(f"resuming at epoch {first}")
    for epoch in range(first, args.epochs):
        bar = tqdm(loader, desc=f"epoch {epoch}", disable=not accelerator.is_local_main_process)
        for xb, yb in bar:
            if epoch == args.fail_epoch and accelerator.process_index == args.fail_rank and \
                    os.environ.get("DDP_UP_ATTEMPT", "0") == "0":
                if args.kill:
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError(f"injected failure in epoch {epoch}")
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            bar.set_postfix(loss=f"{loss.item():.4f}")  # on the bar: ddp-up charts it (runs/<job>/metrics.csv)
        accelerator.save_state(args.out)
        if accelerator.is_main_process:
            with open(done, "w") as f:
                json.dump({"epoch": epoch}, f)
        accelerator.wait_for_everyone()
    accelerator.print(f"trained to epoch {args.epochs} on {accelerator.num_processes} processes "
                      f"({accelerator.distributed_type.value})")


def end(code=0):
    """Leave without the interpreter's teardown: torch 2.13 with gloo can abort there ("terminate
    called without an active exception", SIGABRT) after a run that went well."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
    end()
