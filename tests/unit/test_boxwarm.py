"""Warm start in a container (node/launchers/boxwarm.py), run as the container runs it: the package the
agent writes beside the env file, `python -S -c BOX_MAIN`, and a real warm interpreter (userpython/warmparent.py).
A stand-in for torch (an empty package first on PYTHONPATH) keeps the imports instant, and a
stand-in for torchrun (`-m fakerun`) says whether it was forked warm, then exits or holds. Under
`launcher: none` the ranks themselves (rank.py) say so, in their log files."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.harness import procs

from orchestrator.config.containers import box_code
from orchestrator.node.launchers import boxwarm, container
from orchestrator.node.attempt.placement import TORCHRUN_SIGNALS
from orchestrator.node.local.procs import JOB_SIGNALS

FAKERUN = textwrap.dedent("""\
    import os, signal, sys, time
    print("launcher warm=%s socket=%s" % ("torch" in sys.modules, "DDP_UP_WARM_SOCKET" in os.environ), flush=True)
    if sys.argv[1] == "exit":
        sys.exit(int(sys.argv[2]))
    signal.signal(signal.SIGTERM, lambda sig, _: (print("launcher got", sig, flush=True), sys.exit(5)))
    print("holding", flush=True)
    time.sleep(60)
    """)
RANK = textwrap.dedent("""\
    import os, signal, sys, time
    print("rank %s warm=%s" % (os.environ["RANK"], "torch" in sys.modules), flush=True)
    if sys.argv[1] == "hold":
        signal.signal(signal.SIGTERM, lambda sig, _: (print("saved on", sig, flush=True), sys.exit(0)))
        open("held.%s" % os.environ["RANK"], "w").close()
        time.sleep(60)
    open("printed.%s" % os.environ["RANK"], "w").close()
    if os.environ["RANK"] == "1":  # fails once rank 0 has said its line: the stop that follows may not cut it
        deadline = time.monotonic() + 30
        while not os.path.exists("printed.0") and time.monotonic() < deadline:
            time.sleep(0.01)
    sys.exit(int(sys.argv[2]) if os.environ["RANK"] == "1" else 0)
    """)
OWN = ["ddp-up-launch", "--nproc-per-node=2", "--node-rank=0", "--first-rank=0", "--world-size=2",
       "--master-addr=127.0.0.1", "--master-port=29500", "rank.py"]


@pytest.fixture
def box(tmp_path):
    """(start(mode, *args, cuda=False) -> Popen of boxwarm as a container's first process)."""
    fake = tmp_path / "fake"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text(
        "import os\nclass cuda:\n    is_initialized = staticmethod(lambda: os.environ.get('FAKE_CUDA') == '1')\n")
    (fake / "torch" / "distributed.py").write_text("")
    (fake / "fakerun.py").write_text(FAKERUN)
    (tmp_path / "rank.py").write_text(RANK)
    container.write_package(str(tmp_path / "env.json.code"), box_code("boxwarm"))
    hooks = tmp_path / "hooks.0"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text("print('HOOK RAN in', __import__('os').getpid(), flush=True)\n")
    started = []

    def start(*args: str, cuda: bool = False, own: bool = False) -> subprocess.Popen:
        """``own``: under `launcher: none` (OWN), the ranks' logs under tmp_path/logs."""
        launcher, passed = (OWN, JOB_SIGNALS) if own else ([sys.executable, "-u", "-m", "fakerun"], TORCHRUN_SIGNALS)
        argv = [sys.executable, "-S", "-c", container.BOX_MAIN % "launchers.boxwarm", str(tmp_path / "env.json.code"),
                str(tmp_path / "warm.0.sock"), str(tmp_path / "warm.0.log"), "", ",".join(passed), "2" if own else "1",
                str(hooks), "--", *launcher, *args]
        env = dict(os.environ, PYTHONPATH=f"{hooks}{os.pathsep}{fake}", FAKE_CUDA="1" if cuda else "0",
                   PET_LOG_DIR=str(tmp_path / "logs"), DDP_UP_JOB="20261128-000000-b0c5ed", DDP_UP_NODE="0",
                   DDP_UP_RUN="r1")  # the job's tags, as the container gets them: a rank is signalled by them
        proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def test_torchrun_is_forked_warm_and_its_exit_status_is_the_containers(box):
    proc = box("exit", "3")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, (out, err)
    assert "launcher warm=True socket=True" in out and err == ""
    # the attempt's hook runs in what is forked (torchrun, as at a cold start; each rank), never in the interpreter
    assert out.count("HOOK RAN") == 1, out


def test_a_stop_signal_from_the_runtime_is_passed_on_to_torchrun(box):
    proc = box("hold")
    assert proc.stdout.readline().startswith("HOOK RAN")
    assert proc.stdout.readline() == "launcher warm=True socket=True\n"
    assert proc.stdout.readline() == "holding\n"
    proc.send_signal(signal.SIGTERM)  # `podman kill --signal=SIGTERM`: to the container's first process
    out, err = proc.communicate(timeout=30)
    assert (proc.returncode, out, err) == (5, "launcher got 15\n", "")


def test_an_interpreter_that_cannot_fork_gives_way_to_the_cold_launcher_with_one_notice(box):
    proc = box("exit", "0", cuda=True)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, (out, err)
    assert "launcher warm=False socket=False" in out  # its stand-ins then start their ranks cold
    assert err.count("ddp-up: warm start: importing torch initialized CUDA") == 1, err


def test_the_interpreter_runs_without_the_attempts_hooks_on_its_path():
    env = boxwarm.interpreter_env({"PYTHONPATH": f"/s/hooks.1{os.pathsep}/mine", "X": "1"}, "/s/hooks.1")
    assert env == {"PYTHONPATH": "/mine", "X": "1"}
    assert boxwarm.interpreter_env({"PYTHONPATH": "/s/hooks.1"}, "/s/hooks.1") == {}
    assert Path(boxwarm.__file__).name == "boxwarm.py"


def rank_log(tmp_path: Path, local_rank: int) -> str:
    return (tmp_path / "logs" / "none" / "attempt_0" / str(local_rank) / "stdout.log").read_text()


def test_under_launcher_none_each_rank_is_forked_warm_and_the_first_failure_is_the_containers_status(box, tmp_path):
    proc = box("exit", "3", own=True)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, (out, err)
    logs = [rank_log(tmp_path, r) for r in (0, 1)]
    assert "rank 0 warm=True" in logs[0] and "rank 1 warm=True" in logs[1], logs
    assert [log.count("HOOK RAN") for log in logs] == [1, 1], logs  # each rank runs the hook, once
    assert "exitcode  : 3" in err and "rank      : 1 (local_rank: 1)" in err, err  # the Root Cause block


def test_under_launcher_none_a_stop_signal_reaches_every_rank(box, tmp_path):
    proc = box("hold", "0", own=True)
    assert procs.wait_for(lambda: all((tmp_path / f"held.{r}").exists() for r in (0, 1)) or proc.poll() is not None,
                          timeout=30)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, (out, err)  # every rank saved and exited 0: the stop's status
    assert ["saved on 15" in rank_log(tmp_path, r) for r in (0, 1)] == [True, True]
