"""The code users bring: a Lightning, an Accelerate and a Hugging Face Trainer script
(examples/, tiny models built from configs, nothing downloaded), each at 2 nodes of the sshd
cluster with `restarts: 1`. In the first attempt one rank fails (killed by SIGKILL under
Lightning; raising under the other two); the run names it, starts again, the script resumes from
its own checkpoint and trains to the end, and its progress bar is shown."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest

from tests.harness.runner import ddp_up, run_dir
from tests.integration.conftest import needs

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

TRAINERS = {
    "lightning": ("lightning", "lightning_train.py", ["--epochs", "3", "--fail-epoch", "1", "--kill"], "torchrun",
                  "rank 1 was killed by SIGKILL", "resuming from last.ckpt at world size 2", r"Epoch 2/2\s+\S+\s+8/8", "last.ckpt"),
    "accelerate": ("accelerate", "accelerate_train.py", ["--epochs", "3", "--fail-epoch", "1"], "accelerate",
                   "rank 1 exited with code 1: RuntimeError: injected failure in epoch 1", "resuming at epoch 1",
                   r"epoch 2: 100%\|", "epoch.json"),
    "hf_trainer": ("transformers", "hf_trainer_train.py", ["--steps", "12", "--fail-step", "6"], "torchrun",
                   "rank 1 exited with code 1: RuntimeError: injected failure at step 6", "resuming from checkpoint-4 at world size 2",
                   r"100%\|\S+\| 12/12", "checkpoint-12"),
}


# As users run them: Lightning and the HF Trainer under torchrun, warm (the default); the Accelerate
# script under `accelerate launch` (its ranks start cold: it starts them itself) and under torchrun,
# warm. The cold torchrun start (`warm: false`) is the command line of old, tested in test_cleanup.
CASES = [("lightning", None), ("hf_trainer", None), ("accelerate", False), ("accelerate", True)]


@pytest.mark.long
@pytest.mark.parametrize("name, warm", CASES, ids=["lightning", "hf_trainer", "accelerate-launch", "accelerate-warm"])
def test_a_real_trainer_trains_fails_resumes_from_its_checkpoint_and_shows_its_progress(cluster, cluster_file,
                                                                                          tmp_path, name, warm):
    module, script, args, launcher, cause, resumed, bar, checkpoint = TRAINERS[name]
    needs(module)
    env = {"OMP_NUM_THREADS": 1, "TOKENIZERS_PARALLELISM": "false"}
    if warm and launcher == "accelerate":  # `accelerate launch` starts its ranks cold, itself: the Accelerate
        launcher = "torchrun"              # script forked warm is the same script under torchrun, on the CPU
        env["ACCELERATE_USE_CPU"] = "1"    # as ddp-up's own warning says (accelerate launch sets it)
    out_dir = tmp_path / "ckpt"
    keys = {} if warm is None else {"warm": warm}  # None: the default
    if name == "lightning":  # imported once a node, before the forks: torchmetrics reads LOCAL_RANK then (no rank cold)
        keys["preload"] = ["lightning"]
    path = cluster_file([(0, 1), (1, 1)], launcher=launcher, restarts=1, restart_delay=0.5, env=env, metrics=True, **keys)
    code, out, _ = ddp_up("--no-dashboard", str(path), str(EXAMPLES / script), "--out", str(out_dir), *args,
                          timeout=240)
    assert code == 0, out
    assert re.search(rf"^attempt 0 \(2 node\(s\), world size 2\): \S+ \(node 1, rank 1\): {re.escape(cause)}", out, re.M), out
    assert re.search(rf"\| {re.escape(resumed)}$", out, re.M), out  # from its own checkpoint, in attempt 1
    assert re.search(bar, out), out  # the bar, as its final state
    assert "ok after" in out and "in 2 attempts" in out
    assert not re.search(r"starts? cold", out), out  # warm: the interpreter served every rank, in both attempts
    assert (out_dir / checkpoint).exists()
    # what it learned, with no change to the script: each loss it printed (the HF Trainer's logs,
    # the final state of the others' bars) is a row of metrics.csv, of that rank; both attempts
    printed = {(int(rank), float(value)) for rank, value in
               re.findall(r" r(\d+) [|!] .*(?:'loss': '?|train_loss[=:] ?|loss=)([\d.]+)", out)}
    job = re.search(r"job (\d{8}-\d{6}-\w+)", out).group(1)
    with open(run_dir(job) / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    kept = {(int(r["rank"]), float(r["value"])) for r in rows if r["name"] in ("loss", "train_loss")}
    assert printed and printed <= kept, (printed, kept)
    assert {r["attempt"] for r in rows} == {"0", "1"} and all(r["step"] for r in rows), rows[:5]
