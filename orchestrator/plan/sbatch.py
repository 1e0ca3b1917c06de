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

from ..errors import NodeProblem, SetupError, UsageError
from ..ownfiles import no_link_open, own_dir

MARK = "--sbatch"
SUBMIT_TIMEOUT = 60.0
SBATCH_SCRIPT = "sbatch.sh"  # in the run's directory: the one file there before the batch job runs


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


SECRET_ARG = "DDP_UP_SBATCH_ARG_%d"  # an argument that holds a secret reaches the batch job as this variable


def batch_script(ddp_up_argv: list[str], secrets=frozenset()) -> tuple[str, dict[str, str]]:
    """The script sbatch runs: ddp-up --slurm in the allocation, plain lines (no terminal there);
    the very ddp-up that wrote it (this Python, this package), not whichever is first on PATH.
    An argument holding a secret value is not written: the script reads it from its environment,
    which sbatch passes on from its own. (the script, those variables {name: value})."""
    package_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    command = [sys.executable, "-c", "import sys; sys.path.insert(0, %r); from orchestrator.commands.entry import up; up()"
               % package_parent, "--slurm", "--no-dashboard"]
    words, held = [shlex.quote(a) for a in command], {}
    for i, arg in enumerate(ddp_up_argv):
        if any(secret in arg for secret in secrets):
            held[SECRET_ARG % i] = arg
            words.append(f'"${SECRET_ARG % i}"')
        else:
            words.append(shlex.quote(arg))
    return f"#!/bin/bash\n# written by ddp-up --sbatch: the run inside the allocation\nexec {' '.join(words)}\n", held


def submit(sbatch_options: list[str], ddp_up_argv: list[str], job_id: str, runs_dir: str,
           secrets=frozenset()) -> tuple[str, str]:
    """Write the batch script and submit it: (Slurm's job id, the script's path)."""
    text, held = batch_script(ddp_up_argv, secrets)
    if held and any(o.startswith("--export") for o in sbatch_options):
        raise UsageError("a script argument holds a secret, which reaches the batch job only in the environment "
                         "sbatch passes on: leave out --export, or let the script read the secret from a variable "
                         "(forward_env: in the cluster file)")
    try:
        path = os.path.join(own_dir(os.path.join(runs_dir, job_id), private=True), SBATCH_SCRIPT)
        with os.fdopen(no_link_open(path, fresh=True, mode=0o600), "w", encoding="utf-8") as f:  # private
            f.write(text)
    except OSError as e:
        raise SetupError([NodeProblem("sbatch", f"cannot write the batch script in {runs_dir}: {e.strerror or e}",
                                      "check that --runs-dir is a writable directory of yours")]) from None
    argv = [shutil.which("sbatch") or "sbatch", "--parsable", f"--job-name=ddp-up-{job_id}", *sbatch_options, path]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=SUBMIT_TIMEOUT, stdin=subprocess.DEVNULL,
                              env={**os.environ, **held})
        problem = None if done.returncode == 0 else NodeProblem(
            "sbatch", done.stderr.strip() or f"exit status {done.returncode}", "check the sbatch options")
    except (OSError, subprocess.TimeoutExpired) as e:
        problem = NodeProblem("sbatch", f"cannot submit: {e}", "is Slurm's sbatch on PATH here?")
    if problem is not None:
        os.unlink(path)  # nothing was submitted: no script is left to mislead (or to hold what it holds)
        raise SetupError([problem])
    return done.stdout.strip().split(";")[0], path
