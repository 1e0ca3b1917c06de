"""A Hugging Face Trainer script as its users write them: a tiny BERT built from a config (nothing
is downloaded), a dataset made in memory, checkpoints every few steps, and a resume from the
latest one when the job is started again (ddp-up's `restarts:` does that after a failure).

    ddp-up cluster.yaml examples/hf_trainer_train.py --out ckpt-hf --steps 12

--fail-step N makes rank --fail-rank raise at step N in the first attempt only (DDP_UP_ATTEMPT),
to watch a restart resume from the checkpoint; --kill makes it die of SIGKILL instead.
"""

import argparse
import os
import signal
import sys

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint


class Random(torch.utils.data.Dataset):
    def __init__(self, n=256, length=16, vocab=64):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)
        self.labels = (self.ids.sum(dim=1) % 2).long()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


class FailOnce(TrainerCallback):
    """Fails one rank at one step of the first attempt: a raise, or a SIGKILL as the OOM killer sends."""

    def __init__(self, step, rank, kill):
        self.step, self.rank, self.kill = step, rank, kill

    def on_step_end(self, args, state, control, **kwargs):
        first = os.environ.get("DDP_UP_ATTEMPT", "0") == "0"
        if first and state.global_step == self.step and int(os.environ.get("RANK", "0")) == self.rank:
            if self.kill:
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"injected failure at step {self.step}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="ckpt-hf")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--fail-step", type=int, default=-1)
    p.add_argument("--fail-rank", type=int, default=1)
    p.add_argument("--kill", action="store_true")
    args = p.parse_args()
    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32, num_labels=2)
    training = TrainingArguments(output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=8,
                                 save_strategy="steps", save_steps=4, logging_steps=4, report_to=[], use_cpu=True,
                                 ddp_backend="gloo", dataloader_num_workers=0, seed=0, disable_tqdm=False)
    trainer = Trainer(model=BertForSequenceClassification(config), args=training, train_dataset=Random(),
                      callbacks=[FailOnce(args.fail_step, args.fail_rank, args.kill)] if args.fail_step >= 0 else [])
    last = get_last_checkpoint(args.out) if os.path.isdir(args.out) else None
    if last and trainer.is_world_process_zero():
        print(f"resuming from {os.path.basename(last)} at world size {training.world_size}", flush=True)
    trainer.train(resume_from_checkpoint=last)
    if trainer.is_world_process_zero():
        print(f"trained to step {trainer.state.global_step}", flush=True)


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
