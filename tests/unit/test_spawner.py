"""ddp-up's own launcher (`launcher: none`), run as a real process on torch-free scripts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator import spawner
from orchestrator.logparse import FailureReportParser

WORKER = """
import os, sys, time
names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
print(" ".join("%s=%s" % (n, os.environ[n]) for n in names), "ARGS=%s" % sys.argv[1:], flush=True)
print("to stderr", file=sys.stderr, flush=True)
if os.environ["LOCAL_RANK"] == os.environ.get("FAIL_LOCAL", "-"):
    sys.exit(7)
if os.environ.get("WAIT"):
    open(os.environ["WAIT"] + os.environ["LOCAL_RANK"], "w").close()
    time.sleep(60)
"""


def launch(tmp_path: Path, nproc: int, *args: str, env: dict | None = None, **popen) -> subprocess.Popen:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    argv = [sys.executable, spawner.__file__, f"--nproc-per-node={nproc}", "--node-rank=1", "--first-rank=4",
            "--world-size=8", "--master-addr=10.1.2.3", "--master-port=29500", str(script), *args]
    full_env = {**os.environ, "PET_LOG_DIR": str(tmp_path / "logs"), **(env or {})}
    return subprocess.Popen(argv, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)


def log(tmp_path: Path, local_rank: int, stream: str = "stdout") -> str:
    return (tmp_path / "logs" / "none" / "attempt_0" / str(local_rank) / f"{stream}.log").read_text()


def test_workers_get_the_env_rendezvous_variables_and_torchruns_log_layout(tmp_path):
    proc = launch(tmp_path, 2, "--lr", "0.1", "two words")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    for local in (0, 1):
        assert log(tmp_path, local) == (
            f"RANK={4 + local} LOCAL_RANK={local} WORLD_SIZE=8 LOCAL_WORLD_SIZE=2 GROUP_RANK=1 "
            f"MASTER_ADDR=10.1.2.3 MASTER_PORT=29500 ARGS=['--lr', '0.1', 'two words']\n")
        assert log(tmp_path, local, "stderr") == "to stderr\n"


def test_one_failure_stops_the_others_and_is_reported_as_torchrun_does(tmp_path):
    proc = launch(tmp_path, 3, env={"FAIL_LOCAL": "1", "WAIT": str(tmp_path / "up")})
    _, err = proc.communicate(timeout=30)  # the sleepers are stopped, not waited for (60 s)
    assert proc.returncode == 7
    report = FailureReportParser()
    for line in err.decode().splitlines():
        report.feed(line)
    assert report.root is not None and (report.root.rank, report.root.exit_code) == (5, 7), err


def test_sigterm_is_passed_to_every_worker(tmp_path):
    proc = launch(tmp_path, 2, env={"WAIT": str(tmp_path / "up")})
    try:
        for local in (0, 1):  # both workers are running (they touch a file), then stop the launcher
            wait_for(tmp_path / f"up{local}", proc)
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 30) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


@pytest.mark.parametrize("argv, problem", [
    (["--nproc-per-node=1", "train.py"], "missing: node-rank"),
    (["--nproc-per-node=1", "--bogus=1", "train.py"], "unknown option --bogus"),
])
def test_bad_arguments_are_named(argv, problem):
    with pytest.raises(SystemExit, match=problem):
        spawner.parse(argv)


def test_script_arguments_that_look_like_options_stay_the_scripts():
    argv = [f"--{n}=1" for n in spawner.OPTIONS] + ["train.py", "--nproc-per-node=9", "--x"]
    opts, script, args = spawner.parse(argv)
    assert script == "train.py" and args == ["--nproc-per-node=9", "--x"] and opts["nproc-per-node"] == "1"


def test_launcher_none_needs_no_torch_on_the_node(tmp_path, capsys, monkeypatch):
    """A torch-free program on a python without torch: no torch probe, no refusal (the probe is a
    process per node, paid N times on a big cluster)."""
    import subprocess
    import venv

    from orchestrator.cli import main_up

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
