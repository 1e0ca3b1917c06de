"""Looking at job processes from the test's side: by the tags in /proc/PID/environ."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from orchestrator.remote import sshmaster
from orchestrator.config.cluster import cluster_id_for
from orchestrator.node.local.procs import AGENT_MARK, TAG_CLUSTER, TAG_JOB, find_tagged, is_alive, is_launcher, proc_bytes


def all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def secret_in_cmdlines(value: str) -> list[int]:
    """The processes whose command line holds ``value``."""
    return [pid for pid in all_pids() if value.encode() in (proc_bytes(pid, "cmdline") or b"")]


class TestScope:
    """What the test now running started, so that its leak checks count only that: the job ids its
    launches named (--job-id, or ddp-up's own words "job <id>"), and the cluster files and
    hostfiles in its temporary directory (a job's processes carry the id of the file it was
    launched from). A user's own job, or another test worker's, is none of its business."""

    JOB_WORDS = re.compile(r"\bjob ([A-Za-z0-9][A-Za-z0-9._-]{0,63})")

    def __init__(self, tmp_path: Path):
        self.tmp_path = tmp_path
        self.texts: list = []  # callables: each launch's argv and output so far

    def job_ids(self) -> set[str]:
        return {m for text in self.texts for m in self.JOB_WORDS.findall(text())} | \
            {word for text in self.texts for word in re.findall(r"--job-id[ =]([^\s']+)", text())}

    def cluster_ids(self) -> set[str]:
        ids = set()
        for path in list(self.tmp_path.glob("*")) + list(self.tmp_path.glob("*/*")):
            if path.is_file() and path.stat().st_size < (1 << 20):
                ids.add(cluster_id_for(str(path)))
        return ids

    def owner(self):
        """Whether a process's tags are this test's, with the ids read once: a launch's output can
        be megabytes, and the other workers' jobs put hundreds of tagged processes in each scan."""
        jobs, clusters = self.job_ids(), self.cluster_ids()
        return lambda tags: tags.get(TAG_JOB) in jobs or tags.get(TAG_CLUSTER) in clusters


SCOPE: TestScope | None = None  # set by the suite's autouse fixture for each test (tests/conftest.py)


def job_processes(job: str | None = None, **tags: str) -> list[dict]:
    """Tagged processes: of ``job`` (and ``tags``), or without either, those of the test running."""
    match = {"DDP_UP_JOB": job} if job else {}
    match.update({f"DDP_UP_{k.upper()}": str(v) for k, v in tags.items()})
    found = find_tagged(match)
    if job or tags:
        return found
    owns = (lambda tags: True) if SCOPE is None else SCOPE.owner()
    return [p for p in found if "DDP_UP_JOB" in p["tags"] and owns(p["tags"])]


def wait_no_job_processes(job: str | None, timeout: float) -> list[dict]:
    """Bounded wait until no live process carries the job's tag; returns what is left."""
    deadline = time.monotonic() + timeout
    left = job_processes(job)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = job_processes(job)
    return left


def wait_for(predicate, timeout: float, interval: float = 0.05):
    """Poll ``predicate`` until it returns something truthy; bounded. Returns its last value."""
    deadline = time.monotonic() + timeout
    value = predicate()
    while not value and time.monotonic() < deadline:
        time.sleep(interval)
        value = predicate()
    return value


def alive(pid: int) -> bool:
    return is_alive(pid)


def environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def worker_pid(job: str, rank: int) -> int | None:
    for p in job_processes(job):
        # not a launcher: torchrun, nor under warm start the stand-in torchrun runs for the rank
        if environ(p["pid"]).get("RANK") == str(rank) and not is_launcher(p):
            return p["pid"]
    return None


def agent_pid(job: str, node: int) -> int | None:
    for p in job_processes(job, node=node):
        if AGENT_MARK in p["cmd"]:  # its name in ps (the agent keeps only that on its command line)
            return p["pid"]
    return None


def parent_pid(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return int(stat[stat.rfind(b")") + 2:].split()[1])


def end_orphaned_ssh_runs(timeout: float = 10.0) -> list[str]:
    """What a SIGKILLed ddp-up could not close: the ssh masters of its run (they would end by
    themselves after ControlPersist) and its run directory (the next ddp-up removes it then).
    Tests leave nothing behind, so they end both now, the way ddp-up's own close does. Returns
    the directories it removed."""
    removed = []
    for run in Path(tempfile.gettempdir()).glob("ddp-up-ssh-*"):
        found = sshmaster.RUN_DIR.fullmatch(run.name)
        if not found or alive(int(found.group(1))):
            continue
        for path in sshmaster.control_sockets(str(run)):
            sshmaster.end_master(path, timeout)
        wait_for(lambda: not sshmaster.master_listens(str(run)), timeout)
        shutil.rmtree(run, ignore_errors=True)
        removed.append(str(run))
    return removed
