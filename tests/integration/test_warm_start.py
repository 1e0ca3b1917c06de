"""Warm start (`warm: true`): each node's ranks are forked from an interpreter that imported torch
while the preflight ran, under ddp-up's own launcher and under torchrun (whose workers are then
stand-ins that ask for their rank). The same jobs as cold, on `transport: local` nodes (the agent,
relay and controller path of SSH at a fraction of the cost), and what held cold holds: the root
cause with the rank's exception, ddp-kill, Ctrl-C, nothing left behind."""

from __future__ import annotations

import itertools
import json
import queue
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from orchestrator.node.local.state import state_root
from tests.harness import procs, runner
from tests.harness.runner import ddp_kill, ddp_up, run_dir
from tests.integration.conftest import SCRIPT

LAUNCHERS = pytest.mark.parametrize("launcher", ["none", "torchrun"])


def warm_cluster(tmp_path, launcher="none", **keys):
    return runner.local_cluster(tmp_path, launcher=launcher, warm=True, **keys)


def job_of(out: str) -> str:
    return re.search(r"job (\d{8}-\d{6}-\w+)", out).group(1)


def ready_lines(out: str) -> list[str]:
    return re.findall(r"\| READY rank=\d+ world=\d+ .* warm=(\w+) attempt=", out, re.M)


@LAUNCHERS
def test_a_warm_job_runs_its_ranks_from_the_interpreter_that_imported_torch(tmp_path, launcher):
    path = warm_cluster(tmp_path, launcher, nodes=2, gpus=2)
    code, out, _ = ddp_up("--no-dashboard", str(path), SCRIPT, "run", "--steps", "2", timeout=180)
    assert code == 0, out
    assert ready_lines(out) == ["True"] * 4, out  # every rank found torch imported when its script began
    assert "warm start" not in out, out  # nothing to say: no notice, no fallback
    assert procs.wait_no_job_processes(job_of(out), 15) == []  # the interpreters too


def test_warm_false_is_today_s_cold_start(tmp_path):
    path = runner.local_cluster(tmp_path, nodes=1, gpus=2, launcher="none", warm=False)
    code, out, _ = ddp_up("--no-dashboard", str(path), SCRIPT, "run", "--steps", "1", timeout=180)
    assert code == 0, out
    assert ready_lines(out) == ["False"] * 2, out


@LAUNCHERS
def test_a_warm_rank_that_raises_is_the_root_cause_with_its_exception(tmp_path, launcher):
    path = warm_cluster(tmp_path, launcher, nodes=2, gpus=2)
    code, out, _ = ddp_up("--no-dashboard", str(path), SCRIPT, "run", "--raise-plain", "1", timeout=180)
    assert code == 1, out
    assert re.search(r"^root cause: local-0 \(node 0, rank 1\): rank 1 exited with code 1: RuntimeError: boom from "
                     r"rank 1$", out, re.M), out
    summary = json.loads((run_dir(job_of(out)) / "summary.json").read_text())
    assert summary["root_cause"]["traceback"][-1] == "RuntimeError: boom from rank 1"
    assert procs.wait_no_job_processes(job_of(out), 15) == []


def test_a_preload_that_fails_is_one_notice_and_the_job_still_runs_warm(tmp_path):
    path = warm_cluster(tmp_path, nodes=1, gpus=1, preload=["no_such_module_here"])
    code, out, _ = ddp_up("--no-dashboard", str(path), SCRIPT, "run", "--steps", "1", timeout=180)
    assert code == 0, out
    assert len(re.findall(r"warm start: preload no_such_module_here failed \(ModuleNotFoundError", out)) == 1, out
    assert ready_lines(out) == ["True"], out


@LAUNCHERS
def test_ddp_kill_stops_forked_ranks_and_their_interpreter_and_ps_names_each_rank(tmp_path, launcher):
    path = warm_cluster(tmp_path, launcher, nodes=1, gpus=2)
    launch = runner.Launch(["--no-dashboard", str(path), SCRIPT, "run", "--steps", "1000", "--step-time", "0.2"])
    try:
        launch.wait_line(r"READY rank=1 .* warm=True", 120)
        job = launch.job_id
        for rank in (0, 1):
            cmdline = Path(f"/proc/{procs.worker_pid(job, rank)}/cmdline").read_bytes().split(b"\0")
            assert cmdline[:3] == [sys.executable.encode(), b"-u", SCRIPT.encode()], cmdline
        code, out = ddp_kill(str(path), "--job", job)
        assert code == 0, out
        assert launch.wait(60) != 0, launch.output
    finally:
        if launch.proc.poll() is None:
            launch.signal(signal.SIGKILL)
            launch.wait(10)
    assert procs.wait_no_job_processes(job, 15) == []


@LAUNCHERS
def test_ctrl_c_ends_a_warm_job_and_leaves_nothing(tmp_path, launcher):
    path = warm_cluster(tmp_path, launcher, nodes=2, gpus=1)
    launch = runner.Launch(["--no-dashboard", str(path), SCRIPT, "run", "--steps", "1000", "--step-time", "0.2"])
    launch.wait_line(r"READY rank=1 .* warm=True", 120)
    launch.signal(signal.SIGINT)
    assert launch.wait(60) == 130, launch.output
    assert procs.wait_no_job_processes(launch.job_id, 15) == []


def test_an_attached_restart_forks_from_the_interpreter_made_before_the_failure(tmp_path):
    """Each node's warm interpreter is kept from one attempt to the next: the restart's ranks are
    its children, as the failed attempt's were."""
    path = warm_cluster(tmp_path, "torchrun", nodes=2, gpus=1, restarts=1, restart_delay=0)
    code, out, _ = ddp_up("--no-dashboard", str(path), SCRIPT, "run", "--fail-rank", "1", "--exit-code", "3",
                          "--fail-attempts", "0", timeout=240)
    assert code == 0, out
    parents = dict(re.findall(r"\| READY rank=(\d) world=2 .* ppid=(\d+) warm=True attempt=0$", out, re.M))
    assert len(set(parents.values())) == 2, out  # one interpreter a node
    assert dict(re.findall(r"\| READY rank=(\d) world=2 .* ppid=(\d+) warm=True attempt=1$", out, re.M)) == parents, out
    assert procs.wait_no_job_processes(job_of(out), 15) == []


# ddp-up under a subreaper that reaps only through waitid, as a container's first process started
# without an init (a notebook server) never reaps: every process ddp-up's own processes did not
# reap comes to it, and is named.
ORPHANS = r"""
import ctypes, json, os, signal, subprocess, sys
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
code = subprocess.call(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
left = []

def name(pid):
    with open("/proc/%d/stat" % pid) as f:
        return f.read().split("(", 1)[1].rsplit(")", 1)[0]

def still_running(*_):  # what never ended: named, and killed
    raise TimeoutError

signal.signal(signal.SIGALRM, still_running)
signal.alarm(30)
try:
    while True:  # each one as it ends (WNOWAIT: its name is read before it is reaped)
        pid = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT).si_pid
        left.append(name(pid))
        os.waitpid(pid, 0)
except ChildProcessError:
    pass  # none left
except TimeoutError:
    for pid in [int(p) for p in os.listdir("/proc") if p.isdigit()]:
        try:
            if open("/proc/%d/stat" % pid).read().rsplit(")", 1)[1].split()[1] == str(os.getpid()):
                left.append("running: " + name(pid))
                os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
print(json.dumps({"code": code, "left": left}))
"""


@pytest.mark.parametrize("restarts", [0, 1], ids=["one-attempt", "restarted"])
def test_every_node_reaps_its_warm_interpreter_so_no_zombie_is_left_to_a_pid_1_that_does_not(tmp_path, restarts):
    """In a container without an init (a notebook server first), a process whose parent ends before
    it is a zombie for good: each job left one a node (its warm interpreter, killed at the end)."""
    path = warm_cluster(tmp_path, "none", nodes=1, gpus=1, restarts=restarts, restart_delay=0)
    fails = ["--fail-rank", "0", "--fail-attempts", "0"] if restarts else []
    done = subprocess.run([sys.executable, "-c", ORPHANS, sys.executable, "-c", runner.UP, "--runs-dir", runner.RUNS_ROOT,
                           "--no-dashboard", str(path),
                           SCRIPT, "run", "--steps", "1", *fails],
                          capture_output=True, text=True, timeout=120, env=runner._env())
    assert json.loads(done.stdout) == {"code": 0, "left": []}, done.stderr


# A Python session (a notebook's kernel): two launches of a function, then it waits until the test
# closes its stdin (its normal end) or kills it (a kernel killed).
SESSION = """
import json, sys
from orchestrator import api, launch

def parent():
    import os
    return os.getppid()

for _ in range(2):
    print(json.dumps(launch(sys.argv[1], parent, runs_dir=sys.argv[2]).results), flush=True)
print(json.dumps(sorted(keeper.name for keeper in api.kept().keepers.values())), flush=True)
sys.stdin.read()
"""


def command_name(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def kept_processes(names: list[str]) -> list[int]:
    """The processes of these kept interpreters: their keepers and the interpreters themselves."""
    return [pid for pid in procs.all_pids() if procs.environ(pid).get("DDP_UP_KEEP") in names]


@pytest.mark.parametrize("launcher,end", [("none", "killed"), ("torchrun", "exits")])
def test_a_second_launch_from_python_forks_from_the_interpreter_the_first_made(tmp_path, launcher, end):
    """Its ranks are children of the same warm interpreter on each node as the first launch's; and
    the interpreters end with the Python session, however it ends, leaving nothing: not even what a
    preload started at import (a helper process), which ends by the rule every job's processes follow."""
    (tmp_path / "spawner.py").write_text("import subprocess\nsubprocess.Popen(['sleep', '300'])\n")
    path = warm_cluster(tmp_path, launcher, nodes=2, gpus=2, preload=["spawner"])
    session = subprocess.Popen([sys.executable, "-c", SESSION, str(path), str(tmp_path / "runs")], cwd=runner.REPO,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=lambda: [lines.put(line) for line in itertools.chain(session.stdout, [""])],
                     daemon=True).start()
    said, out = [], []
    try:
        while len(said) < 3 and (not out or out[-1]):  # "": the session ended
            out.append(lines.get(timeout=240))
            if out[-1].startswith(("{", "[")):
                said.append(json.loads(out[-1]))
        assert len(said) == 3, "".join(out)
        first, second, names = said
        assert len(set(first.values())) == 2 and first == second, "".join(out)  # one interpreter a node, both times
        assert sorted(set(kept_processes(names)) & set(first.values())) == sorted(set(first.values()))
        helpers = [pid for pid in kept_processes(names) if command_name(pid) == "sleep"]
        assert len(helpers) == 2, kept_processes(names)  # one a node's interpreter started at import
    finally:
        if end == "killed":  # a notebook's kernel killed: no atexit, the kernel closes its pipes
            session.kill()
        else:
            session.stdin.close()
        session.wait(60)
    assert procs.wait_for(lambda: not kept_processes(names), 30), kept_processes(names)
    assert not [p for p in Path(state_root()).glob(".warm-*") if p.name[len(".warm-"):] in names]
