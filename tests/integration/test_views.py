"""Issue 4: log files complete, and the live dashboard in a real terminal (tmux)."""

from __future__ import annotations

import json
import re
import shlex
import sys

from tests.harness import procs
from tests.harness.runner import REPO, RUNS_ROOT, UP, ddp_up, run_dir
from tests.integration.conftest import SCRIPT

LAUNCHER = "none"  # torchrun is not what these tests are about (see conftest.cluster_file)


def test_log_files_hold_every_line(cluster, cluster_file):
    path = cluster_file([(0, 2), (1, 2)], launcher="torchrun")  # torch in every rank: warm, one import a node
    code, out, _ = ddp_up("--ranks", "0", str(path), SCRIPT, "run", "--steps", "40")
    assert code == 0, out
    job = re.search(r"job (\S+):", out).group(1)
    d = run_dir(job)
    for rank in range(4):
        lines = (d / f"rank{rank}.log").read_text().split("\n")  # stdout and stderr (c10d warnings too)
        assert [l for l in lines if l.startswith("step ")] == [f"step {i} rank={rank}" for i in range(40)]
        assert sum(l.startswith(f"READY rank={rank} world=4") for l in lines) == 1
    node1 = (d / f"node1-{cluster.nodes[1].addr}.log").read_text()
    assert node1.count("r2 | step ") == 40 and node1.count("r3 | step ") == 40
    assert "step 3 rank=2" not in out and "step 3 rank=0" in out  # the console was filtered, the files not
    summary = json.loads((d / "summary.json").read_text())
    assert [n["state"] for n in summary["nodes"]] == ["done", "done"] and summary["exit_code"] == 0


def test_dashboard_in_a_real_terminal(cluster, cluster_file, tmux):
    path = cluster_file([(0, 1), (1, 1), (2, 1)])
    env = f"PYTHONPATH={shlex.quote(str(REPO))} COLUMNS= LINES="
    cmd = (f"cd {shlex.quote(str(REPO))} && env {env} {shlex.quote(sys.executable)} -c {shlex.quote(UP)} "
           f"--runs-dir {shlex.quote(RUNS_ROOT)} {path} {SCRIPT} tick 25 0.4; "
           f"echo EXIT=$?; tmux -L {tmux.socket} wait-for -S ddp-up-done; sleep 60")
    tmux("new-session", "-d", "-s", "dash", "-x", "160", "-y", "45", cmd)
    addrs = [n.addr for n in cluster.nodes[:3]]

    def live_rows():
        screen = tmux("capture-pane", "-p", "-t", "dash")
        rows = [l for l in screen.splitlines() if re.match(r"\s+\d+\s+10\.213\.\d+\.\d+\s+\d\s+running\s", l)]
        return screen if "world 3" in screen and len(rows) == 3 else None

    screen = procs.wait_for(live_rows, timeout=90, interval=0.2)
    assert screen, tmux("capture-pane", "-p", "-t", "dash")
    for i, addr in enumerate(addrs):
        assert re.search(rf"^\s+{i}\s+{re.escape(addr)}\s+{i}\s+running\s+\d+:\d\d\s+\d+\s+\d+\s+", screen, re.M), screen

    tmux("wait-for", "ddp-up-done")  # the command signals this channel when ddp-up has exited
    final = tmux("capture-pane", "-p", "-t", "dash")
    assert "EXIT=0" in final, final
    for i, addr in enumerate(addrs):
        assert re.search(rf"│ {i}\s+│ {re.escape(addr)}\s+│ {i}\s+│ done\s+│ 0", final), final
    assert not re.search(r"^\s+\d+\s+10\.213\.\S+\s+\d\s+running", final, re.M)  # live table gone, summary stays


def test_a_burst_of_output_is_delivered_whole(cluster, cluster_file):
    """More output than the node can send before the job ends: every line still arrives."""
    lines = 150_000
    path = cluster_file([(0, 1), (1, 1)])
    code, out, _ = ddp_up("--ranks", "0", str(path), SCRIPT, "spam", str(lines))
    assert code == 0, out[-3000:]
    d = run_dir(re.search(r"job (\S+):", out).group(1))
    for rank in range(2):
        got = (d / f"rank{rank}.log").read_text().split("\n")  # not splitlines(): it also splits on \x1c-\x1e
        numbers = [int(l.rsplit(" ", 1)[1]) for l in got if l.startswith(f"rank {rank} x")]
        assert numbers == list(range(lines)), f"rank {rank}: {len(numbers)} of {lines} lines, in order?"


def test_the_dashboard_after_a_restart_shows_the_new_attempt(tmux, tmp_path):
    """A rank fails once and the run restarts under the live table: in a real terminal every line
    of attempt 1 shows as printed, and the table is attempt 1's (2 local nodes x 2 ranks)."""
    from tests.harness.runner import local_cluster

    path = local_cluster(tmp_path, nodes=2, gpus=2, launcher="none", restarts=1, restart_delay=0.2)
    env = f"PYTHONPATH={shlex.quote(str(REPO))} COLUMNS= LINES="
    cmd = (f"cd {shlex.quote(str(tmp_path))} && env {env} {shlex.quote(sys.executable)} -c {shlex.quote(UP)} "
           f"--runs-dir {shlex.quote(RUNS_ROOT)} {path} {SCRIPT} tick 50 0.1 3 4 0; "
           f"echo EXIT=$?; tmux -L {tmux.socket} wait-for -S ddp-up-done; sleep 60")
    tmux("new-session", "-d", "-s", "dash", "-x", "200", "-y", "50", cmd)

    def second_attempt():
        screen = tmux("capture-pane", "-p", "-t", "dash")
        return screen if "attempt 1" in screen and re.search(r"r3 \| tick 20 rank=3$", screen, re.M) else None

    screen = procs.wait_for(second_attempt, timeout=90, interval=0.2)
    assert screen, tmux("capture-pane", "-p", "-t", "dash")
    rank_lines = [line for line in screen.splitlines() if re.match(r"local-\d r\d ", line)]
    assert rank_lines and all(re.fullmatch(r"local-\d r(\d) +\| tick \d+ rank=\1", line) for line in rank_lines), screen
    header = [line for line in screen.splitlines() if "ddp-up job" in line]
    assert len(header) == 1 and "attempt 1" in header[0] and "running" in header[0], screen
    assert re.search(r"^\s+1\s+local-1\s+2-3\s+running\s.*tick \d+ rank=\d$", screen, re.M), screen  # attempt 1's row
    tmux("wait-for", "ddp-up-done")
    assert "EXIT=0" in tmux("capture-pane", "-p", "-t", "dash")
