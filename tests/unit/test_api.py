"""The Python API: the same run as the command line, its answer as a value; a failure raised with
the rank's exception; a detached job as a handle; files back."""

from __future__ import annotations

import sys

import pytest

import orchestrator
from orchestrator import JobFailed, LaunchRefused, launch


def cluster(tmp_path, gpus: int = 2) -> dict:
    return {"transport": "local", "python": sys.executable, "workdir": str(tmp_path), "launcher": "none",
            "nodes": [{"host": "a", "gpus": gpus}]}


def test_a_run_comes_back_as_a_value_and_a_failure_as_the_ranks_exception(tmp_path):
    script = tmp_path / "t.py"
    script.write_text("import os, sys\nprint('hi from', os.environ['RANK'])\n"
                      "if len(sys.argv) > 1 and os.environ['RANK'] == '1': raise ValueError('bad value 7')\n")
    run = launch(cluster(tmp_path), str(script), runs_dir=str(tmp_path / "runs"))
    assert run.exit_code == 0 and run.results == {0: 0, 1: 0} and run.summary["world_size"] == 2
    assert "hi from 1" in (tmp_path / "runs" / run.job_id / "rank1.log").read_text()
    with pytest.raises(JobFailed) as failed:
        launch(cluster(tmp_path), str(script), ["fail"], runs_dir=str(tmp_path / "runs"), hang_timeout="5m")
    e = failed.value
    assert "rank 1 on a (node 0): ValueError: bad value 7" in str(e) and e.exception_type == "ValueError"
    assert "raise ValueError('bad value 7')" in e.remote_traceback and e.run.results[1] == 1


def test_bad_input_raises_and_starts_nothing(tmp_path):
    with pytest.raises(LaunchRefused):
        launch(cluster(tmp_path), str(tmp_path / "missing.py"), runs_dir=str(tmp_path / "runs"))
    with pytest.raises(TypeError, match="unknown option"):
        launch(cluster(tmp_path), "t.py", hang_timout=5)
    with pytest.raises(TypeError, match="cluster must be"):
        launch(["a"], "t.py")


def test_a_detached_job_is_a_handle_ddp_ls_sees(tmp_path):
    script = tmp_path / "t.py"
    script.write_text("import time\nfor i in range(3):\n    print('tick', i, flush=True)\n    time.sleep(0.2)\n")
    job = launch(cluster(tmp_path, gpus=1), str(script), runs_dir=str(tmp_path / "runs"), detach=True)
    try:
        assert job.wait(poll=0.5, timeout=60)["state"] == "done"
        assert "tick 2" in job.logs()
    finally:
        job.kill()
        from orchestrator.commands.kill import main_kill

        main_kill([job.cluster, "--job", job.job_id, "--purge"])  # its record, kept 7 days: the test's own
    assert orchestrator.fetch is not None and orchestrator.__version__


def test_ctrl_c_stops_the_job_with_its_grace_and_reaches_the_caller_as_keyboard_interrupt(tmp_path):
    import json
    import secrets
    import signal
    import subprocess
    script = tmp_path / "t.py"
    script.write_text("import signal, sys, time\n"
                      "signal.signal(signal.SIGTERM, lambda *a: (print('saved', flush=True), sys.exit(0)))\n"
                      "print('started', flush=True)\ntime.sleep(120)\n")
    job = f"api-ctrl-c-{secrets.token_hex(3)}"
    caller = ("import sys\nfrom orchestrator import launch\n"
              f"try:\n    launch({json.dumps(cluster(tmp_path, gpus=1))}, {str(script)!r}, job_id={job!r}, "
              f"runs_dir={str(tmp_path / 'runs')!r})\n"
              "except KeyboardInterrupt as e:\n    print('CAUGHT', e, flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", caller], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    try:
        for line in proc.stdout:  # bounded: the caller ends within the job's own limits, or is killed below
            seen.append(line)
            if "r0 | started" in line:
                break
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    out = "".join(seen) + out
    log = tmp_path / "runs" / job / "rank0.log"
    assert f"CAUGHT job {job} stopped by Ctrl-C" in out, out
    assert "saved" in log.read_text()  # the rank got its grace
