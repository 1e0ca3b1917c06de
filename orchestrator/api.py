"""ddp-up from Python: the same run as the command line (one implementation: the call is ddp-up's
own, in this process), its answer as a value.

    from orchestrator import launch, JobFailed
    run = launch("cluster.yaml", "train.py", ["--epochs", "3"], hang_timeout="10m")
    run.results      # {global rank: exit code}
    run.summary      # what runs/<job>/summary.json holds
    run.run_dir

A failed run raises JobFailed, which names the root cause (rank, host, the rank's exception) and
carries the remote traceback and the summary. Ctrl-C (a notebook's "interrupt kernel") stops the
job as on the command line, every rank with its grace, and raises KeyboardInterrupt.
``detach=True`` returns a Detached handle on the job that ddp-ls and ddp-attach see.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import time
from dataclasses import dataclass, field

import yaml

from .ownfiles import no_link_open, own_dir
from .plan.launch import new_job_id

# Keyword options, as the command line's: name -> (flag, takes a value)
OPTIONS = {"hang_timeout": ("--hang-timeout", True), "restarts": ("--restarts", True), "ranks": ("--ranks", True),
           "sync": ("--sync", False), "preflight": ("--no-preflight", False), "collapse": ("--collapse", False),
           "allow_busy_gpus": ("--allow-busy-gpus", False), "dashboard": ("--dashboard", False)}


@dataclass(frozen=True)
class Run:
    """A run that ended: its job id, its directory, its exit status, summary.json's content, and
    each global rank's exit code (0 for every rank of a run that succeeded)."""

    job_id: str
    run_dir: str
    exit_code: int
    summary: dict = field(repr=False)
    results: dict[int, int | None] = field(default_factory=dict)


class JobFailed(Exception):
    """The run failed. ``str()`` names the root cause; ``run``, ``summary``, ``exception_type``
    (the rank's exception's type name) and ``remote_traceback`` (its last lines) say the rest."""

    def __init__(self, run: Run):
        root = run.summary.get("root_cause") or {}
        self.run, self.summary = run, run.summary
        exception = root.get("exception") or ""
        self.exception_type = exception.split(":", 1)[0] if ":" in exception else None
        self.remote_traceback = "\n".join(root.get("traceback") or ())
        where = f"rank {root.get('rank')} on {root.get('host')} (node {root.get('node')})" if root else "the job"
        super().__init__(f"job {run.job_id} failed (exit status {run.exit_code}): {where}: "
                         f"{exception or root.get('what') or 'see ' + run.run_dir}")


class LaunchRefused(ValueError):
    """Nothing was started: bad input (exit 2) or a node not ready (exit 3); the reason was printed."""


def launch(cluster, target: str, args=(), *, job_id: str | None = None, runs_dir: str = "runs",
           detach: bool = False, **options):
    """Run ``target`` (a script path, or ``-m module``: ``target="-m", args=["pkg.train", ...]``) on
    ``cluster`` (a cluster-file path, or the same data as a dict) with ``args``; ``options`` are
    the command line's (hang_timeout, restarts, ranks, sync, preflight, collapse, allow_busy_gpus,
    dashboard). A Run, or with ``detach`` a Detached handle."""
    from .commands.up import main_up

    job_id = job_id or new_job_id()
    path = cluster_path(cluster, runs_dir, job_id)
    argv = ["--runs-dir", runs_dir, "--job-id", job_id, *flags(options), *(["--detach"] if detach else []),
            path, target, *map(str, args)]
    code = main_up(argv)
    if code in (2, 3):
        raise LaunchRefused(f"ddp-up started nothing (exit status {code}): its message says why")
    if code >= 128:
        if code == 128 + signal.SIGINT:
            raise KeyboardInterrupt(f"job {job_id} stopped by Ctrl-C; every node stopped it")
        raise InterruptedError(f"job {job_id} stopped by signal {code - 128}")
    if detach:
        return Detached(path, job_id, runs_dir)
    return ended(job_id, os.path.join(runs_dir, job_id), code)


def flags(options: dict) -> list[str]:
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"launch() got unknown option(s) {', '.join(unknown)}; it takes {', '.join(OPTIONS)}")
    out = []
    for name, value in options.items():
        flag, takes = OPTIONS[name]
        if takes and value is not None:
            out += [flag, str(value)]
        elif not takes and (not value if name == "preflight" else value):
            out.append(flag)
    return out


def cluster_path(cluster, runs_dir: str, job_id: str) -> str:
    """A path as given; a dict written as the job's own cluster file (private, kept beside its run
    directory: ddp-kill and ddp-attach find the job by it)."""
    if isinstance(cluster, (str, os.PathLike)):
        return os.fspath(cluster)
    if not isinstance(cluster, dict):
        raise TypeError(f"cluster must be a cluster file's path or its data as a dict, not {type(cluster).__name__}")
    where = own_dir(os.path.join(runs_dir, ".clusters"), private=True)
    path = os.path.join(where, f"{job_id}.yaml")
    with os.fdopen(no_link_open(path, fresh=True), "w") as f:
        f.write(yaml.safe_dump(cluster, sort_keys=False))
    return path


def ended(job_id: str, run_dir: str, code: int) -> Run:
    try:
        with open(os.path.join(run_dir, "summary.json")) as f:
            summary = json.load(f)
    except (OSError, ValueError):
        summary = {}
    results: dict[int, int | None] = {}
    for node in summary.get("nodes") or ():
        first, last = (node.get("ranks") or [0, -1])[:2]  # the node's first and last global rank
        for rank in range(first, last + 1):
            results[rank] = 0 if code == 0 else None
    root = summary.get("root_cause") or {}
    if isinstance(root.get("rank"), int) and code != 0:
        results[root["rank"]] = root.get("exit_code")
    run = Run(job_id, run_dir, code, summary, results)
    if code != 0:
        raise JobFailed(run)
    return run


@dataclass
class Detached:
    """A detached job: the one ddp-ls, ddp-attach and ddp-kill see."""

    cluster: str
    job_id: str
    runs_dir: str = "runs"

    def status(self) -> dict:
        """The job's ddp-ls row (state: running, restarting, done, failed, stopped, lost)."""
        from .commands.attach import main_ls

        out = quietly(main_ls, [self.cluster, "--json"])
        rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        return next((r for r in rows if r.get("job") == self.job_id), {"job": self.job_id, "state": "unknown"})

    def logs(self) -> str:
        """Every line of every rank so far, as ddp-logs prints them."""
        from .commands.attach import main_logs

        return quietly(main_logs, [self.cluster, self.job_id, "--runs-dir", self.runs_dir])

    def wait(self, poll: float = 2.0, timeout: float | None = None) -> dict:
        """Until the job has ended (its ddp-ls row then); TimeoutError after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            row = self.status()
            if row.get("state") not in ("running", "restarting", "unknown"):
                return row
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {self.job_id} still {row.get('state')} after {timeout} s")
            time.sleep(poll)

    def kill(self) -> int:
        """Stop it for good, every rank with its grace (ddp-kill --job); ddp-kill's exit status."""
        from .commands.kill import main_kill

        return main_kill([self.cluster, "--job", self.job_id])


def quietly(main, argv: list[str]) -> str:
    """A command's stdout, as text."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(argv)
    return out.getvalue()
