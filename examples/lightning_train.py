"""A Lightning script as its users write them: `Trainer(num_nodes=..., strategy="ddp")`, a tiny
model, a checkpoint every epoch (`last.ckpt`), and a resume from it when the job is started again
(ddp-up's `restarts:` does that after a failure). Lightning reads the ranks torchrun gives.

    ddp-up cluster.yaml examples/lightning_train.py --out ckpt-pl --epochs 3

--fail-epoch N makes rank --fail-rank raise in epoch N of the first attempt only (DDP_UP_ATTEMPT);
--kill makes it die of SIGKILL instead. Lightning's bar is its default, Rich's where rich is
installed: ddp-up shows it live, as a terminal would.
"""

import argparse
import os
import signal
import sys

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint


class Tiny(L.LightningModule):
    def __init__(self, fail_epoch=-1, fail_rank=1, kill=False):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
        self.fail = (fail_epoch, fail_rank, kill)

    def training_step(self, batch, _):
        x, y = batch
        epoch, rank, kill = self.fail
        first = os.environ.get("DDP_UP_ATTEMPT", "0") == "0"
        if first and self.current_epoch == epoch and self.global_rank == rank:
            if kill:
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"injected failure in epoch {epoch}")
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss, prog_bar=True)  # on the bar: ddp-up charts it (runs/<job>/metrics.csv)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="ckpt-pl")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--fail-epoch", type=int, default=-1)
    p.add_argument("--fail-rank", type=int, default=1)
    p.add_argument("--kill", action="store_true")
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
    nodes = int(os.environ.get("WORLD_SIZE", "1")) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    trainer = L.Trainer(num_nodes=nodes, devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), accelerator="cpu",
                        strategy="ddp", max_epochs=args.epochs, logger=False, enable_model_summary=False,
                        callbacks=[ModelCheckpoint(dirpath=args.out, save_last=True)])
    last = os.path.join(args.out, "last.ckpt")
    resume = last if os.path.exists(last) else None
    if resume and trainer.global_rank == 0:
        print(f"resuming from last.ckpt at world size {trainer.world_size}", flush=True)
    trainer.fit(Tiny(args.fail_epoch, args.fail_rank, args.kill),
                torch.utils.data.DataLoader(data, batch_size=16), ckpt_path=resume)
    if trainer.global_rank == 0:
        print(f"trained to epoch {trainer.current_epoch}", flush=True)


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
