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


def test_a_function_runs_on_every_rank_and_each_ranks_return_value_comes_back(tmp_path):
    """A closure of this test's (cloudpickle ships a local function by value), with its arguments."""
    offset = 100

    def where(tag, by=1):
        import os

        return tag, int(os.environ["RANK"]) * by + offset

    run = launch(cluster(tmp_path), where, ("t",), {"by": 10}, backend=None, runs_dir=str(tmp_path / "runs"))
    assert run.exit_code == 0 and run.results == {0: ("t", 100), 1: ("t", 110)}
    assert run.summary["world_size"] == 2 and run.run_dir == str(tmp_path / "runs" / run.job_id)


def test_a_functions_exception_is_the_root_cause_and_a_function_cannot_detach(tmp_path):
    def fails():
        import os

        if os.environ["RANK"] == "1":
            raise KeyError("missing shard 3")
        return "fine"

    with pytest.raises(JobFailed) as failed:
        launch(cluster(tmp_path), fails, backend=None, runs_dir=str(tmp_path / "runs"))
    e = failed.value
    assert "rank 1 on a (node 0): KeyError: 'missing shard 3'" in str(e) and e.exception_type == "KeyError"
    assert "in fails\nKeyError: 'missing shard 3'" in e.remote_traceback  # its source stays here: no line shown
    with pytest.raises(LaunchRefused, match="fails: a function's results come back to its caller"):
        launch(cluster(tmp_path), fails, detach=True, runs_dir=str(tmp_path / "runs"))
    with pytest.raises(TypeError, match="kwargs are a function's"):
        launch(cluster(tmp_path), "t.py", (), {"a": 1})


def test_every_line_reaches_the_callers_function_and_one_that_raises_is_dropped_not_the_job(tmp_path, capfd):
    script = tmp_path / "t.py"
    script.write_text("import os\nprint('hello', os.environ['RANK'], '\\x1b[2J')\n")
    seen = []
    run = launch(cluster(tmp_path), str(script), runs_dir=str(tmp_path / "runs"), on_line=seen.append)
    ours = sorted((line.host, line.rank, line.stream, line.text) for line in seen if line.rank is not None)
    assert run.exit_code == 0 and ours == [("a", 0, "out", "hello 0 "), ("a", 1, "out", "hello 1 ")]  # no escape

    def broken(line):
        raise RuntimeError("my callback")

    assert launch(cluster(tmp_path), str(script), runs_dir=str(tmp_path / "runs"), on_line=broken).exit_code == 0
    said = capfd.readouterr()
    assert "on_line raised RuntimeError: my callback; it is not called again (the job goes on)" in said.out + said.err


def test_bad_input_raises_and_starts_nothing(tmp_path):
    with pytest.raises(LaunchRefused, match=r"exit status 3\): a: script \S+missing.py not found in "):
        launch(cluster(tmp_path), str(tmp_path / "missing.py"), runs_dir=str(tmp_path / "runs"))
    with pytest.raises(TypeError, match="unknown option"):
        launch(cluster(tmp_path), "t.py", hang_timout=5, runs_dir=str(tmp_path / "refused"))
    assert not (tmp_path / "refused").exists()  # refused before anything was written (the cluster's file)
    with pytest.raises(TypeError, match="cluster must be"):
        launch(["a"], "t.py")


@pytest.mark.parametrize("bad", [object(), lambda: 1])
def test_a_cluster_dict_yaml_cannot_write_and_a_refused_launch_leave_no_cluster_file(tmp_path, bad):
    runs = tmp_path / "runs"
    with pytest.raises(TypeError, match="a cluster given as a dict holds strings, numbers"):
        launch(dict(cluster(tmp_path), env={"X": bad}), str(tmp_path / "t.py"), runs_dir=str(runs))
    assert not (runs / ".clusters").exists() or list((runs / ".clusters").iterdir()) == []
    with pytest.raises(LaunchRefused):  # refused by the validator (exit 2), then by the node (exit 3)
        launch(dict(cluster(tmp_path), restarts=-1), str(tmp_path / "t.py"), runs_dir=str(runs))
    with pytest.raises(LaunchRefused):
        launch(cluster(tmp_path), str(tmp_path / "missing.py"), runs_dir=str(runs))
    assert list((runs / ".clusters").iterdir()) == []


def test_a_detached_job_is_a_handle_ddp_ls_sees(tmp_path):
    script = tmp_path / "t.py"
    script.write_text("import time\nfor i in range(3):\n    print('tick', i, flush=True)\n    time.sleep(0.2)\n")
    job = launch(cluster(tmp_path, gpus=1), str(script), runs_dir=str(tmp_path / "runs"), detach=True)
    try:
        assert job.wait(poll=0.5, timeout=60)["state"] == "done"
        assert "tick 2" in job.logs()
        listed_here(job.job_id, str(tmp_path / "runs"))
    finally:
        job.kill()
        from orchestrator.commands.kill import main_kill

        main_kill([job.cluster, "--job", job.job_id, "--purge"])  # its record, kept 7 days: the test's own
    assert orchestrator.fetch is not None and orchestrator.__version__


def listed_here(job_id: str, runs: str) -> None:
    """`ddp-ls` with no argument: the detached jobs started from here (their run records), asked of
    their nodes; with none started, one message and exit 2."""
    import contextlib
    import io
    import json
    import os

    from orchestrator.commands.attach import main_ls

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main_ls(["--runs-dir", runs, "--json"]) == 0
    assert [json.loads(line)["job"] for line in out.getvalue().splitlines()] == [job_id]
    empty = os.path.join(runs, "empty")
    os.mkdir(empty)
    assert main_ls(["--runs-dir", empty]) == 2


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


def test_files_come_back_through_the_api_and_a_local_node_without_a_workdir_is_where_the_user_is(tmp_path,
                                                                                                  monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs").mkdir()
    (tmp_path / "outputs" / "model.pt").write_bytes(b"weights")
    nodes = {"transport": "local", "python": sys.executable, "nodes": [{"host": "a", "gpus": 1}]}
    rows = orchestrator.fetch(nodes, "outputs", str(tmp_path / "back"))
    assert [(r["node"], r["files"], r["error"]) for r in rows] == [("a", 1, None)]
    assert (tmp_path / "back" / "a" / "outputs" / "model.pt").read_bytes() == b"weights"
    assert orchestrator.fetch(nodes, "outputs", str(tmp_path / "back"))[0]["unchanged"] == 1  # not sent again
    with pytest.raises(orchestrator.FetchFailed, match="No such file or directory") as failed:
        orchestrator.fetch(nodes, "missing", str(tmp_path / "back"))
    assert failed.value.rows[0]["node"] == "a"
    (tmp_path / "a-file").write_text("")
    with pytest.raises(LaunchRefused, match="ddp-fetch copied nothing"):  # a folder that cannot be made
        orchestrator.fetch(nodes, "outputs", str(tmp_path / "a-file" / "back"))


def test_a_node_whose_python_cannot_import_cloudpickle_is_refused_before_anything_starts(tmp_path, capfd):
    broken = tmp_path / "site" / "cloudpickle"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('no cloudpickle on this node')\n")
    nodes = {**cluster(tmp_path), "env": {"PYTHONPATH": str(tmp_path / "site")}}
    with pytest.raises(LaunchRefused, match="exit status 3"):
        launch(nodes, len, ([1],), runs_dir=str(tmp_path / "runs"))
    err = capfd.readouterr().err
    assert "cloudpickle cannot be imported by" in err and "ImportError: no cloudpickle on this node" in err, err
    assert "-m pip install cloudpickle" in err and "Traceback" not in err
