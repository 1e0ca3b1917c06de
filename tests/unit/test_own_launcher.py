"""`launcher: none`: the agent starts the workers itself (workers.Workers), real processes here."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from orchestrator.node.local import procs
from orchestrator.node.launchers import workers
from orchestrator.node.watch.report import FailureReportParser

WORKER = """
import os, sys, time
names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
print(" ".join("%s=%s" % (n, os.environ[n]) for n in names), "ARGS=%s" % sys.argv[1:], flush=True)
print("to stderr", file=sys.stderr, flush=True)
if os.environ["LOCAL_RANK"] == os.environ.get("FAIL_LOCAL", "-"):
    sys.exit(7)
if os.environ.get("SAVE_EXIT"):  # a SIGTERM handler that saves, then exits with the code given for this worker
    import signal
    code = int(os.environ["SAVE_EXIT"].split(",")[int(os.environ["LOCAL_RANK"])])
    signal.signal(signal.SIGTERM, lambda *_: os._exit(code))
if os.environ.get("WAIT"):
    open(os.environ["WAIT"] + os.environ["LOCAL_RANK"], "w").close()
    time.sleep(60)
"""


class Launch:
    """Workers started as the agent starts them, with a unique tag set (signals check tags)."""

    def __init__(self, tmp_path: Path, nproc: int, *args: str, env: dict | None = None):
        script = tmp_path / "worker.py"
        script.write_text(WORKER)
        self.tmp = tmp_path
        self.match = {procs.TAG_JOB: "own-launcher-test", procs.TAG_NODE: "1", procs.TAG_RUN: os.urandom(6).hex()}
        self.reports: list[str] = []
        argv = [f"--nproc-per-node={nproc}", "--node-rank=1", "--first-rank=4", "--world-size=8",
                "--master-addr=10.1.2.3", "--master-port=29500", str(script), *args]
        self.workers = workers.Workers(workers.parse_launch(argv), {**os.environ, **self.match, **(env or {})},
                                     self.match, self.reports.append)
        self.workers.start(str(tmp_path / "logs"))

    def wait(self, timeout: float = 30) -> int:
        return self.workers.wait(timeout)

    def log(self, local_rank: int, stream: str = "stdout") -> str:
        return (self.tmp / "logs" / "none" / "attempt_0" / str(local_rank) / f"{stream}.log").read_text()

    def wait_for(self, name: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not (self.tmp / name).exists():
            assert self.workers.poll() is None, self.reports
            assert time.monotonic() < deadline, f"{name} never appeared"
            time.sleep(0.02)

    def close(self) -> None:
        procs.kill_tagged(self.match, grace=0, first_signal=signal.SIGKILL)


@pytest.fixture
def launch(tmp_path):
    started: list[Launch] = []

    def start(*args, **kwargs) -> Launch:
        started.append(Launch(tmp_path, *args, **kwargs))
        return started[-1]
    yield start
    for one in started:
        one.close()


def test_workers_get_the_env_rendezvous_variables_and_torchruns_log_layout(launch):
    run = launch(2, "--lr", "0.1", "two words")
    assert run.wait() == 0 and run.reports == []
    for local in (0, 1):
        assert run.log(local) == (
            f"RANK={4 + local} LOCAL_RANK={local} WORLD_SIZE=8 LOCAL_WORLD_SIZE=2 GROUP_RANK=1 "
            f"MASTER_ADDR=10.1.2.3 MASTER_PORT=29500 ARGS=['--lr', '0.1', 'two words']\n")
        assert run.log(local, "stderr") == "to stderr\n"


def test_one_failure_stops_the_others_and_is_reported_as_torchrun_does(launch, tmp_path):
    run = launch(3, env={"FAIL_LOCAL": "1", "WAIT": str(tmp_path / "up")})
    assert run.wait() == 7  # the sleepers are stopped, not waited for (60 s)
    report = FailureReportParser()
    for line in "".join(run.reports).splitlines():
        report.feed(line)
    assert report.root is not None and (report.root.rank, report.root.exit_code) == (5, 7), run.reports


def test_a_stop_reaches_every_worker_and_is_not_reported_as_a_failure(launch, tmp_path):
    run = launch(2, env={"WAIT": str(tmp_path / "up")})
    for local in (0, 1):  # both workers are running (they touch a file), then stop them
        run.wait_for(f"up{local}")
    run.workers.send_signal(signal.SIGTERM)
    assert run.wait() == 128 + signal.SIGTERM and run.reports == []


@pytest.mark.parametrize("codes, node", [("0,0", 0), ("0,3", 3)])
def test_in_a_stop_the_node_exits_with_its_workers_own_codes(launch, tmp_path, codes, node):
    """Issue 27, item 1: a rank that exits by itself within the grace shows its own exit code
    (0: it saved and ended), not 128+SIGTERM."""
    run = launch(2, env={"WAIT": str(tmp_path / "up"), "SAVE_EXIT": codes})
    for local in (0, 1):
        run.wait_for(f"up{local}")
    run.workers.send_signal(signal.SIGTERM)
    assert run.wait() == node and run.reports == []


def test_workers_the_agent_kills_at_the_end_are_not_a_failure_to_report(launch, tmp_path):
    run = launch(2, env={"WAIT": str(tmp_path / "up")})
    for local in (0, 1):
        run.wait_for(f"up{local}")
    run.workers.ending()
    run.close()  # SIGKILL to every tagged process, as Runner.finish does
    assert run.wait() == 128 + signal.SIGKILL and run.reports == []


def test_a_worker_that_cannot_be_started_fails_the_node_with_the_reason(tmp_path):
    (tmp_path / "logs").write_text("a file where the log directory goes")
    match = {procs.TAG_JOB: "own-launcher-test", procs.TAG_NODE: "1", procs.TAG_RUN: os.urandom(6).hex()}
    reports: list[str] = []
    argv = [f"--{n}=1" for n in workers.LAUNCH_OPTIONS] + ["worker.py"]
    started = workers.Workers(workers.parse_launch(argv), {**os.environ, **match}, match, reports.append)
    started.start(str(tmp_path / "logs"))
    assert started.wait(30) == 1
    assert len(reports) == 1 and reports[0].startswith("ddp-up-launch: cannot start local rank 0: ")


@pytest.mark.parametrize("argv, problem", [
    (["--nproc-per-node=1", "train.py"], "missing node-rank"),
    (["--nproc-per-node=1", "--bogus=1", "train.py"], "unknown option --bogus"),
])
def test_bad_arguments_are_named(argv, problem):
    with pytest.raises(ValueError, match=problem):
        workers.parse_launch(argv)


def test_script_arguments_that_look_like_options_stay_the_scripts():
    argv = [f"--{n}=1" for n in workers.LAUNCH_OPTIONS] + ["train.py", "--nproc-per-node=9", "--x"]
    opts, script, args = workers.parse_launch(argv)
    assert script == "train.py" and args == ["--nproc-per-node=9", "--x"] and opts["nproc-per-node"] == "1"


def test_launcher_none_needs_no_torch_on_the_node(tmp_path, capsys, monkeypatch):
    """A torch-free program on a python without torch: no torch probe, no refusal (the probe is a
    process per node, paid N times on a big cluster)."""
    import subprocess
    import venv

    from orchestrator.commands.up import main_up

    venv.create(tmp_path / "venv", with_pip=False)  # no site-packages of ours: no torch
    python = tmp_path / "venv" / "bin" / "python"
    assert subprocess.run([python, "-c", "import torch"], capture_output=True, timeout=60).returncode != 0
    (tmp_path / "t.py").write_text("print('no torch here, and fine')\n")
    (tmp_path / "c.yaml").write_text(f"launcher: none\npython: {python}\ntransport: local\n"
                                     "nodes: [{host: a, gpus: 1}]\n")
    monkeypatch.chdir(tmp_path)
    code = main_up(["--no-dashboard", "--runs-dir", str(tmp_path / "runs"), str(tmp_path / "c.yaml"), "t.py"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "no torch here, and fine" in out
