"""Issue 5 (hang part): a rank stuck in a collective is found, its stack dumped, and the job stopped."""

from __future__ import annotations

import os
import re
import sys

import pytest

from tests.harness import procs
from tests.harness.runner import ddp_up
from tests.integration.conftest import SCRIPT

LAUNCHER = "none"  # the hang watch is ddp-up's, whatever starts the ranks (see conftest.cluster_file)

HANG_TIMEOUT = 15  # above torch's import time on a loaded 2-core machine: ranks are silent until READY


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_hung_collective_is_detected_dumped_and_stopped(cluster, cluster_file, warm):
    # No py-spy on the job's PATH: the dump hook (faulthandler on a real-time signal) does it. Warm:
    # the ranks are forked from the node's warm interpreter, and run the same hook when they begin.
    path = cluster_file([(0, 1), (1, 2)], hang_timeout=HANG_TIMEOUT, stop_grace=3, warm=warm,
                        env={"OMP_NUM_THREADS": 1, "PATH": "/usr/bin:/bin"})
    code, out, seconds = ddp_up(str(path), SCRIPT, "hang", timeout=90)
    assert code == 1, out
    assert f"job looks hung: no output from any rank for {HANG_TIMEOUT}" in out, out
    b = re.escape(cluster.nodes[1].addr)
    # rank 2's own stack (stderr, attributed to it) shows where it blocks
    assert re.search(rf"^{b}\s+r2\s+! .*line \d+ in block_forever$", out, re.M), out
    assert re.search(r"^\S+\s+r0\s+! .*line \d+ in wait_for_peers$", out, re.M), out
    # issue 28: the Flight Recorder says who everyone waits for: ranks 0-1 never called it
    a = re.escape(cluster.nodes[0].addr)
    assert re.search(rf"root cause: {a} \(node 0, rank 0\): job hung \(no output from any rank for \d+ s\); "
                     r"ranks 0-1 never entered all_reduce #2 on the default group \(Flight Recorder\); "
                     r"rank 2 in all_reduce \(from block_forever\); the other 2 rank\(s\) not in a collective "
                     r"\(wait_for_peers\)", out), out
    assert re.search(rf"collectives: Flight Recorder: on the default group, every rank completed all_reduce #1; "
                     rf"ranks 0-1 \({a}, \.\.\.\) never entered all_reduce #2; rank 2 waits in it\.", out), out
    assert "Error in sitecustomize" not in out
    assert "Current thread 0x" in out, out  # the ranks' own threads are shown,
    assert "sitecustomize.py\", line" not in out, out  # and ddp-up's Flight Recorder thread is not
    assert not procs.wait_no_job_processes(None, 10)



def test_hang_dump_uses_py_spy_when_the_jobs_path_has_it(cluster, cluster_file):
    bin_dir = os.path.dirname(sys.executable)  # where pip put py-spy (the test extra)
    assert os.path.exists(os.path.join(bin_dir, "py-spy")), "pip install -e '.[test]' installs py-spy"
    path = cluster_file([(0, 1), (1, 2)], hang_timeout=HANG_TIMEOUT, stop_grace=3,
                        env={"OMP_NUM_THREADS": 1, "PATH": f"{bin_dir}:/usr/bin:/bin"})
    code, out, seconds = ddp_up(str(path), SCRIPT, "hang", timeout=90)
    assert code == 1, out
    b = re.escape(cluster.nodes[1].addr)
    assert re.search(rf"^{b}\s+r2\s+! ddp-up: py-spy dump of pid \d+ \(rank 2\)$", out, re.M), out
    assert re.search(rf"^{b}\s+r2\s+! \s+block_forever \(job\.py:\d+\)$", out, re.M), out
    assert re.search(r"rank 2 in all_reduce \(from block_forever\); the other 2 rank\(s\) not in a collective", out), out
    assert '"ddp-up-flight-recorder"' not in out  # py-spy names the recorder's thread: it is left out too
    assert not procs.wait_no_job_processes(None, 10)
