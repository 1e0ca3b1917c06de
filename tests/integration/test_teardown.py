"""A job whose every rank ended its script is not called failed because a rank then died in the
interpreter's teardown (torch's C++ threads at exit abort it now and then): the node says so, the
job succeeds, and `restarts:` does not run it again. A script that failed first still fails."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.harness import runner
from tests.harness.runner import ddp_up, run_dir

SCRIPT = str(Path(__file__).parent.parent / "scripts" / "teardown.py")
LAUNCHERS = pytest.mark.parametrize("launcher", ["none", "torchrun"])


@LAUNCHERS
def test_a_death_after_every_script_ended_is_not_a_failure_and_is_not_restarted(tmp_path, launcher):
    path = runner.local_cluster(tmp_path, nodes=2, gpus=2, launcher=launcher, restarts=1, restart_delay=0)
    code, out, _ = ddp_up("--no-dashboard", str(path), SCRIPT, "--barrier", str(tmp_path / "barrier"), timeout=180)
    assert code == 0, out
    assert out.count("SCRIPT ENDED") == 4, out  # one attempt: no restart
    assert re.search(r"! ddp-up: every rank ended its script, then the launcher .*not counted as a failure", out), out
    assert re.search(r"ddp-up job \S+ ok after", out), out
    summary = json.loads((run_dir(re.search(r"job (\d{8}-\d{6}-\w+)", out).group(1)) / "summary.json").read_text())
    assert [n["state"] for n in summary["nodes"]] == ["done", "done"]
    assert all("not counted as a failure" in n["reason"] for n in summary["nodes"]), summary["nodes"]


@LAUNCHERS
@pytest.mark.parametrize("how", [["--exit", "3"], ["--raise"]])
def test_a_script_that_failed_before_its_teardown_still_fails(tmp_path, launcher, how):
    path = runner.local_cluster(tmp_path, nodes=1, gpus=2, launcher=launcher)
    code, out, _ = ddp_up("--no-dashboard", str(path), SCRIPT, *how, timeout=180)
    assert code == 1, out
    assert "not counted as a failure" not in out, out
    if how == ["--raise"]:
        assert re.search(r"RuntimeError: boom before the teardown", out), out


# Every way a script can end with a failure, warm and cold: the rank's own code is the truth, with the
# teardown's abort after it (every rank then dies of SIGABRT, after an end the rank's hook heard) or not.
ENDS = [["--end", "raise", "3"], ["--end", "exit", "3"], ["--end", "quit", "3"], ["--end", "_exit", "3"],
        ["--end", "kill", "15"]]


@pytest.mark.parametrize("launcher,warm,ends", [("torchrun", False, ENDS), ("torchrun", True, ENDS[:1]),
                                                ("none", True, ENDS[:1]), ("none", False, ENDS[:1])])
def test_every_way_a_script_ends_with_a_failure_fails_the_job(tmp_path, launcher, warm, ends):
    """Every way under torchrun, cold (the rank's code from the launcher's report); the bare raise,
    which no exit function hears, under each launcher warm and cold."""
    path = runner.local_cluster(tmp_path, nodes=1, gpus=1, launcher=launcher, warm=warm)
    for how in ends:
        code, out, _ = ddp_up("--no-dashboard", str(path), SCRIPT, *how, timeout=180)
        assert code == 1, (how, out)  # a job failed: never 0, whatever the teardown did
        assert "not counted as a failure" not in out and not re.search(r"ddp-up job \S+ ok after", out), (how, out)


@LAUNCHERS
def test_ranks_that_ended_their_scripts_are_finishing_not_hung_while_their_teardown_runs(tmp_path, launcher):
    """The ranks' last line, then 2 s in the C library's exit list each (torch's threads at exit):
    with hang_timeout well under that, no stack is asked for, and the job ends ok."""
    script = tmp_path / "slow_exit.py"
    script.write_text("import ctypes, os\nlibc = ctypes.CDLL(None)\n"
                      "libc.__cxa_atexit(ctypes.cast(libc.sleep, ctypes.c_void_p), ctypes.c_void_p(2), None)\n"
                      "print(f'LAST LINE rank={os.environ[\"RANK\"]}', flush=True)\n")
    path = runner.local_cluster(tmp_path, nodes=2, gpus=1, launcher=launcher, hang_timeout=0.8)
    code, out, _ = ddp_up("--no-dashboard", str(path), str(script), timeout=120)
    assert code == 0 and out.count("LAST LINE") == 2, out
    assert "looks hung" not in out and "stack" not in out.lower(), out


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_a_rank_killed_by_a_signal_is_the_root_cause_not_the_peers_it_left(tmp_path, warm):
    """Its peer on another node raises "Connection reset by peer" a moment after the kill, and its
    node says so first (the killed rank's torchrun looks at its workers every 1.5 s here, a slow
    node's, where the peer's does every 0.1 s): the killed rank's node still names its own death,
    which came first, before it passes the stop on."""
    import yaml

    from tests.integration.conftest import SCRIPT as JOB

    path = runner.local_cluster(tmp_path, nodes=2, gpus=1, warm=warm)
    data = yaml.safe_load(path.read_text())
    data["nodes"][1]["env"] = {"OMP_NUM_THREADS": 1, "PET_MONITOR_INTERVAL": 1.5}  # torchrun's --monitor-interval
    path.write_text(yaml.safe_dump(data))
    code, out, _ = ddp_up("--no-dashboard", str(path), JOB, "run", "--kill-rank", "1", timeout=180)
    assert code == 1, out
    assert re.search(r"root cause: local-1 \(node 1, rank 1\): rank 1 (was )?killed by SIGKILL", out), out


def test_a_death_in_teardown_on_a_node_other_than_the_master_does_not_hold_the_job():
    """Its torchrun ends without torchrun's exit barrier, where the master's waits for it (300 s):
    the job ends ok within seconds, and the master's torchrun prints no "Error waiting on exit
    barrier" traceback (the node whose rank died prints torchrun's report of it, and says why that
    is no failure)."""
    import tempfile

    with tempfile.TemporaryDirectory() as where:
        tmp_path = Path(where)
        path = runner.local_cluster(tmp_path, nodes=2, gpus=1, launcher="torchrun")
        code, out, took = ddp_up("--no-dashboard", str(path), SCRIPT, "--only-rank", "1", timeout=120)
    assert code == 0 and out.count("SCRIPT ENDED") == 2, out
    assert took < 60 and "Error waiting on exit barrier" not in out, (took, out)
    assert "not counted as a failure" in out, out
