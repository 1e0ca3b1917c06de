"""ddp-up from Python: the same run as the command line (one implementation: the call is ddp-up's
own, in this process), its answer as a value.

    from orchestrator import launch, JobFailed
    run = launch("cluster.yaml", "train.py", ["--epochs", "3"], hang_timeout="10m")
    run.results      # {global rank: exit code}
    run.summary      # what runs/<job>/summary.json holds
    run.run_dir

    def train(lr):                    # defined here: a notebook cell, a __main__ script
        ...
        return torch.distributed.get_rank()
    launch("cluster.yaml", train, (0.1,)).results    # {global rank: what train returned there}

A function is shipped by value with cloudpickle (plan/call.py); the nodes need cloudpickle too.
Its ranks' return values come back over the agents' own channels and are unpickled here: the
nodes are trusted as the user's own, as with any code the user runs there.

A failed run raises JobFailed, which names the root cause (rank, host, the rank's exception) and
carries the remote traceback and the summary. Ctrl-C (a notebook's "interrupt kernel") stops the
job as on the command line, every rank with its grace, and raises KeyboardInterrupt.
``detach=True`` returns a Detached handle on the job that ddp-ls and ddp-attach see.

With ``warm: true`` in the cluster, each node keeps its warm interpreter (torch imported) from one
launch to the next, for as long as this Python process lives: a second launch forks its ranks at
once. ``release_warm()`` ends them sooner.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import tempfile
import time
from dataclasses import dataclass, field, replace

import yaml

from .errors import UsageError
from .ownfiles import no_link_open, own_dir
from .plan.launch import new_job_id

# Keyword options, as the command line's: name -> (flag, takes a value)
OPTIONS = {"hang_timeout": ("--hang-timeout", True), "restarts": ("--restarts", True), "ranks": ("--ranks", True),
           "sync": ("--sync", False), "preflight": ("--no-preflight", False), "collapse": ("--collapse", False),
           "allow_busy_gpus": ("--allow-busy-gpus", False), "allow_unhealthy_gpus": ("--allow-unhealthy-gpus", False),
           "dashboard": ("--dashboard", False)}


@dataclass(frozen=True)
class Run:
    """A run that ended: its job id, its directory, its exit status, summary.json's content, and
    each global rank's result: a function's return value, or a script's exit code (0 for every
    rank of a run that succeeded)."""

    job_id: str
    run_dir: str
    exit_code: int
    summary: dict = field(repr=False)
    results: dict = field(default_factory=dict)
    cluster: str = ""  # the cluster file it ran on (a dict's: written beside its run directory)

    def fetch(self, remote_path: str, local_dir: str, node: str | None = None) -> list[dict]:
        """Files back from the run's nodes (see ``fetch``)."""
        return fetch(self.cluster, remote_path, local_dir, node)


class JobFailed(Exception):
    """The run failed. ``str()`` names the root cause; ``run``, ``summary``, ``exception_type``
    (the rank's exception's type name) and ``remote_traceback`` (its last lines) say the rest."""

    def __init__(self, run: Run, why: str | None = None):
        root = run.summary.get("root_cause") or {}
        self.run, self.summary = run, run.summary
        exception = root.get("exception") or ""
        self.exception_type = exception.split(":", 1)[0] if ":" in exception else None
        self.remote_traceback = "\n".join(root.get("traceback") or ())
        where = f"rank {root.get('rank')} on {root.get('host')} (node {root.get('node')})" if root else "the job"
        super().__init__(f"job {run.job_id}: {why}" if why else f"job {run.job_id} failed (exit status {run.exit_code}): "
                         f"{where}: {exception or root.get('what') or 'see ' + run.run_dir}")


class LaunchRefused(ValueError):
    """Nothing was started: bad input (exit 2) or a node not ready (exit 3); the reason was printed."""


def launch(cluster, target, args=(), kwargs=None, *, backend: str | None = "auto", job_id: str | None = None,
           runs_dir: str = "runs", detach: bool = False, on_line=None, **options):
    """Run ``target`` on ``cluster`` (a cluster-file path, or the same data as a dict): a function,
    called on every rank with ``args`` and ``kwargs`` after the process group is up (``backend``:
    "auto" picks nccl with CUDA, else gloo; None: no group), or a script path (or ``-m module``:
    ``target="-m", args=["pkg.train", ...]``) with ``args``. ``options`` are the command line's
    (hang_timeout, restarts, ranks, sync, preflight, collapse, allow_busy_gpus,
    allow_unhealthy_gpus, dashboard).
    ``on_line(line)`` gets every line of every rank (views/callback.Line: host, node, rank, stream,
    text) as it arrives. A Run, or with ``detach`` (scripts only) a Detached handle."""
    from .commands.up import main_up
    from .plan.call import MODULE
    from .run.runloop import Caller

    call = shipped(target, args, kwargs, backend)
    if call and detach:
        raise LaunchRefused(f"{call.name}: a function's results come back to its caller, which a detached job "
                            "has not: launch a script to detach")
    job_id = job_id or new_job_id()
    given = flags(options)  # an unknown option is refused before anything is written
    path = cluster_path(cluster, runs_dir, job_id)
    script = ["-m", MODULE] if call else [os.fspath(target), *map(str, args)]
    argv = ["--runs-dir", runs_dir, "--job-id", job_id, *given, *(["--detach"] if detach else []), path, *script]
    results: list = []
    code = main_up(argv, Caller(call, results.append, on_line, kept=kept(), page_behind=True))
    if code in (2, 3):
        if path != cluster:  # the dict's file: nothing started, so nothing will look for it
            os.unlink(path)
        raise LaunchRefused(refusal(code, read_summary(os.path.join(runs_dir, job_id))))
    if code >= 128:
        if code == 128 + signal.SIGINT:
            raise KeyboardInterrupt(f"job {job_id} stopped by Ctrl-C; every node stopped it")
        raise InterruptedError(f"job {job_id} stopped by signal {code - 128}")
    if detach:
        return Detached(path, job_id, runs_dir)
    run = ended(job_id, os.path.join(runs_dir, job_id), code, path)
    return replace(run, results=returned(run, results[-1].values if results else {})) if call else run


_KEPT = []  # this process's kept interpreters (run/kept.Kept), made at the first launch


def kept():
    """This session's warm interpreters, kept from one launch to the next (`warm: true`)."""
    if not _KEPT:
        from .run.kept import Kept

        _KEPT.append(Kept())
    return _KEPT[0]


def release_warm() -> None:
    """End this session's kept warm interpreters now, on every node (they end with this process
    anyway): the next launch starts new ones."""
    if _KEPT:
        _KEPT[0].close()


def shipped(target, args, kwargs, backend):
    """The Call for a function (LaunchRefused if it cannot go), None for a script."""
    from .plan.call import Call

    if not callable(target):
        if kwargs:
            raise TypeError("kwargs are a function's; a script takes its arguments in args")
        return None
    try:
        return Call.of(target, args, kwargs, backend)
    except UsageError as e:
        raise LaunchRefused(e.render()) from None


def returned(run: "Run", values: dict) -> dict:
    """Every rank's return value, unpickled here (pickle imports cloudpickle's rebuilders by name);
    JobFailed if one did not come back whole."""
    import pickle

    out = {}
    for rank in sorted(run.results):
        value = values.get(rank)
        why = value if isinstance(value, str) else "it left no result" if value is None else None
        if why is None:
            try:
                out[rank] = pickle.loads(value)
                continue
            except Exception as e:  # a class this Python cannot import, a value that fails to rebuild
                why = f"its return value cannot be rebuilt here: {type(e).__name__}: {e}"
        raise JobFailed(run, f"rank {rank}'s return value did not come back: {why}")
    return out


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
    try:
        text = yaml.safe_dump(cluster, sort_keys=False)  # first: a value YAML cannot write leaves no file
    except yaml.YAMLError as e:
        raise TypeError(f"cluster: {e}; a cluster given as a dict holds strings, numbers, booleans, lists and "
                        "dicts, as a cluster file does") from None
    where = own_dir(os.path.join(runs_dir, ".clusters"), private=True)
    path = os.path.join(where, f"{job_id}.yaml")
    with os.fdopen(no_link_open(path, fresh=True), "w") as f:
        f.write(text)
    return path


def read_summary(run_dir: str) -> dict:
    """The run's summary.json, or {} where it has none (nothing got that far)."""
    try:
        with open(os.path.join(run_dir, "summary.json")) as f:
            summary = json.load(f)
    except (OSError, ValueError):
        return {}
    return summary if isinstance(summary, dict) else {}


def refusal(code: int, summary: dict) -> str:
    """Why nothing started, in the exception too: each node not ready and its reason, from the run's
    summary (bad input has none: the message printed says why)."""
    nodes = [n for n in summary.get("nodes") or () if isinstance(n, dict) and n.get("reason")]
    why = "; ".join(f"{n.get('host')}: {n['reason']}" for n in nodes[:3]) + (" ..." if len(nodes) > 3 else "")
    return f"ddp-up started nothing (exit status {code}): {why or 'its message says why'}"


def ended(job_id: str, run_dir: str, code: int, cluster: str = "") -> Run:
    summary = read_summary(run_dir)
    results: dict[int, int | None] = {}
    for node in summary.get("nodes") or ():
        first, last = (node.get("ranks") or [0, -1])[:2]  # the node's first and last global rank
        for rank in range(first, last + 1):
            results[rank] = 0 if code == 0 else None
    root = summary.get("root_cause") or {}
    if isinstance(root.get("rank"), int) and code != 0:
        results[root["rank"]] = root.get("exit_code")
    run = Run(job_id, run_dir, code, summary, results, cluster)
    if code != 0:
        raise JobFailed(run)
    return run


class FetchFailed(OSError):
    """A node's files did not all come back; ``rows`` has every node's account (ddp-fetch --json's)."""

    def __init__(self, message: str, rows: list[dict]):
        super().__init__(message)
        self.rows = rows


def fetch(cluster, remote_path: str, local_dir: str, node: str | None = None) -> list[dict]:
    """ddp-fetch from Python: ``remote_path`` (relative to each node's workdir, or absolute) from
    every node of ``cluster`` (a path, or the same data as a dict) into ``local_dir/<node>/``, or
    from ``node`` into ``local_dir``; only what changed is sent again. Each node's account (files,
    bytes, unchanged...); LaunchRefused for bad input, FetchFailed if a node's copy failed."""
    from .commands.fetch import main_fetch

    with tempfile.TemporaryDirectory() as private:  # a dict's cluster file, for this call only (0700)
        path = cluster_path(cluster, private, "fetch")
        out, code = quietly(main_fetch, [path, remote_path, local_dir, "--json",
                                         *(["--node", str(node)] if node is not None else [])])
    rows = json_lines(out)
    if code == 2:
        raise LaunchRefused(f"ddp-fetch copied nothing (exit status {code}): its message says why")
    failed = [r for r in rows if r.get("error")]
    if failed:
        raise FetchFailed(f"{failed[0]['node']}: {failed[0]['error']}", rows)
    return rows


@dataclass
class Detached:
    """A detached job: the one ddp-ls, ddp-attach and ddp-kill see."""

    cluster: str
    job_id: str
    runs_dir: str = "runs"

    def status(self) -> dict:
        """The job's ddp-ls row (state: running, restarting, done, failed, stopped, lost)."""
        from .commands.attach import main_ls

        out, _ = quietly(main_ls, [self.cluster, "--json"])
        mine = (row for row in json_lines(out) if row.get("job") == self.job_id)
        return next(mine, {"job": self.job_id, "state": "unknown"})

    def logs(self) -> str:
        """Every line of every rank so far, as ddp-logs prints them."""
        from .commands.attach import main_logs

        return quietly(main_logs, [self.cluster, self.job_id, "--runs-dir", self.runs_dir])[0]

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


def json_lines(out: str) -> list[dict]:
    """The objects a command's ``--json`` printed, one a line."""
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def quietly(main, argv: list[str]) -> tuple[str, int]:
    """A command's stdout, as text, and its exit status."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    return out.getvalue(), code
