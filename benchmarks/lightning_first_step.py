"""The Lightning example (examples/lightning_train.py) as it is, run as a rank's script, with one
line more: `FIRST STEP rank=N` when that rank begins its first training step, for
benchmarks/warm_trainer.py to time. Runs the example's own main and end."""

import os
import runpy
import sys

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "examples", "lightning_train.py")

example = runpy.run_path(EXAMPLE, run_name="lightning_example")
tiny, step = example["Tiny"], example["Tiny"].training_step


def first_step(self, batch, index):
    if index == 0 and self.current_epoch == 0:
        print("FIRST STEP rank=%d" % self.global_rank, flush=True)
    return step(self, batch, index)


tiny.training_step = first_step
sys.argv[0] = EXAMPLE
example["main"]()
example["end"]()
