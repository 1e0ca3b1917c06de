"""`ddp-up --sbatch [SBATCH OPTIONS] CLUSTER.yaml SCRIPT ARGS...`: a batch job that runs
`ddp-up --slurm` inside its allocation.

The batch script is written to the run's directory (``runs/<job>/sbatch.sh``) and submitted with
the options given; the job id of the run is chosen here, so the logs' place is known before the
job starts. sbatch passes this shell's environment on (its default), so the same ddp-up and
Python run there. Nothing is started on any node from here.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys

from .errors import NodeProblem, SetupError, UsageError

MARK = "--sbatch"
SUBMIT_TIMEOUT = 60.0


def split_sbatch(argv: list[str], options_end: int | None = None) -> tuple[list[str] | None, list[str]]:
    """(sbatch's options, the rest for ddp-up) from ``--sbatch OPTION... [--] CLUSTER.yaml ...``:
    sbatch's options run to a ``--`` or to the first argument naming a .yaml/.yml file. None if
    --sbatch is not among ddp-up's own leading options (``argv[:options_end]``): after the script,
    it is the script's."""
    if MARK not in argv[:options_end]:
        return None, argv
    at = argv.index(MARK)
    before, after = argv[:at], argv[at + 1:]
    for i, arg in enumerate(after):
        if arg == "--":
            return after[:i], before + after[i + 1:]
        if arg.endswith((".yaml", ".yml")):
            return after[:i], before + after[i:]
    raise UsageError("--sbatch: end sbatch's options with -- or the cluster file, e.g. "
                     "ddp-up --sbatch -N4 --time=2:00:00 cluster.yaml train.py")


def batch_script(ddp_up_argv: list[str]) -> str:
    """The script sbatch runs: ddp-up --slurm in the allocation, plain lines (no terminal there)."""
    launcher = shutil.which("ddp-up")
    command = [launcher] if launcher else [sys.executable, "-c", "from orchestrator.entry import up; up()"]
    return ("#!/bin/bash\n# written by ddp-up --sbatch: the run inside the allocation\n"
            f"exec {shlex.join([*command, '--slurm', '--no-dashboard', *ddp_up_argv])}\n")


def submit(sbatch_options: list[str], ddp_up_argv: list[str], job_id: str, runs_dir: str) -> tuple[str, str]:
    """Write the batch script and submit it: (Slurm's job id, the script's path)."""
    where = os.path.join(runs_dir, job_id)
    os.makedirs(where, exist_ok=True)
    path = os.path.join(where, "sbatch.sh")
    with open(path, "w", encoding="utf-8") as f:
        f.write(batch_script(ddp_up_argv))
    argv = [shutil.which("sbatch") or "sbatch", "--parsable", f"--job-name=ddp-up-{job_id}", *sbatch_options, path]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=SUBMIT_TIMEOUT, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SetupError([NodeProblem("sbatch", f"cannot submit: {e}", "is Slurm's sbatch on PATH here?")]) from None
    if done.returncode != 0:
        raise SetupError([NodeProblem("sbatch", done.stderr.strip() or f"exit status {done.returncode}",
                                      "check the sbatch options")])
    return done.stdout.strip().split(";")[0], path
