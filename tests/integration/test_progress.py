"""Issue 29: progress bars live (the dashboard in tmux, plain snapshots, the log files), the
job's events sent to a local HTTP server and a command, and what ran recorded.

The nodes are `transport: local` (the same agent, relay and controller path as over SSH, at a
fraction of the cost); the HTTP server listens on 127.0.0.1 only."""

from __future__ import annotations

import functools
import json
import re
import shlex
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.harness import procs, runner
from tests.harness.runner import REPO, RUNS_ROOT, UP, ddp_kill, ddp_up, run_dir
from tests.integration.conftest import SCRIPT

BARS = str(Path(SCRIPT).with_name("bars.py"))
# the bars' subject is the relay and the views, the same under any launcher (see conftest.cluster_file)
local_cluster = functools.partial(runner.local_cluster, launcher="none")
pytest.importorskip("tqdm")


def job_of(out: str) -> str:
    return re.search(r"job (\d{8}-\d{6}-\w+)", out).group(1)


# (the bar's word, its final state, what moves in the dashboard's last-line cell)
FORMS = {"tqdm": ("train:", r"train: 100%\|\S+\| {n}/{n} \[", r"train:\s+(\d+)%"),  # real tqdm, on stderr
         "hand": ("step", r"step 100%\| {n}/{n} \[", r"step\s+(\d+)%"),  # "\r" and the figures, by hand
         # Rich's, as Lightning's RichProgressBar draws it, on stdout (live: node/attempt/placement.TERMINAL_ENV)
         "rich": ("train", r"train \S+ {n}/{n} \d:\d\d:\d\d \u2022 \d:\d\d:\d\d", r"train \S+ (\d+)/40")}


@pytest.mark.parametrize("form", FORMS)
def test_a_bar_moves_in_place_in_the_dashboard(tmp_path, tmux, form):
    word, final, moves = FORMS[form]
    path = local_cluster(tmp_path)
    env = f"PYTHONPATH={shlex.quote(str(REPO))} COLUMNS= LINES="
    cmd = (f"cd {shlex.quote(str(tmp_path))} && env {env} {shlex.quote(sys.executable)} -c {shlex.quote(UP)} "
           f"--runs-dir {shlex.quote(RUNS_ROOT)} {path} {BARS} {form} 40 0.1; "
           f"echo EXIT=$?; tmux -L {tmux.socket} wait-for -S ddp-up-done; sleep 60")
    tmux("new-session", "-d", "-s", "bars", "-x", "200", "-y", "40", cmd)
    seen: set[str] = set()
    row = re.compile(rf"^\s*0\s+local-0\s+0\s+running\s.*?\d+% \S+it/s eta \d+:\d\d.*{moves}", re.M)

    def moving():
        screen = tmux("capture-pane", "-p", "-t", "bars")
        found = row.search(screen)
        if found:
            seen.add(found.group(1))
            # in the table, once a node (and a rank's final line, once it ended): not a line per update
            assert screen.count(word) <= 4, screen
        return len(seen) >= 4

    assert procs.wait_for(moving, timeout=90, interval=0.2), (seen, tmux("capture-pane", "-p", "-t", "bars"))
    tmux("wait-for", "ddp-up-done")
    screen = tmux("capture-pane", "-p", "-S", "-", "-t", "bars")  # with what scrolled off (torch's own noise)
    assert "EXIT=0" in screen, screen
    assert re.search(r"r0 [!|] " + final.format(n=40), screen), screen  # the bar's final state, one line
    assert screen.count(word) == 2, screen  # and nothing else of it: one line a rank


@pytest.mark.parametrize("form", FORMS)
def test_plain_output_and_the_log_files_keep_snapshots_and_the_final_state(tmp_path, form):
    word, final, _ = FORMS[form]
    path = local_cluster(tmp_path)
    code, out, _ = ddp_up("--no-dashboard", str(path), BARS, form, "30", "0.08", timeout=90)
    assert code == 0, out
    shown = [line for line in out.splitlines() if word in line and " r0 " in line]
    assert 1 <= len(shown) <= 3, out  # a snapshot at most every 10 s, and the final state
    assert re.search(final.format(n=30), shown[-1]), out
    log = (run_dir(job_of(out)) / "rank0.log").read_text()
    assert log.count(word) <= 3 and "\r" not in log and len(log) < 1000, log
    assert re.search(r"^" + final.format(n=30) + r".*(\]|it/s)$", log, re.M), log


def test_under_a_live_rich_bar_a_long_line_and_a_warning_arrive_whole(tmp_path):
    """Rich prints a rank's own lines itself while its bar is live, cut at its width: the ranks get
    one that no line reaches (node/attempt/placement.TERMINAL_ENV), on every rank alike."""
    path = local_cluster(tmp_path)
    code, out, _ = ddp_up("--no-dashboard", str(path), BARS, "richlines", "10", "0.05", timeout=90)
    assert code == 0, out
    for rank in (0, 1):
        log = (run_dir(job_of(out)) / f"rank{rank}.log").read_text()
        assert re.search(rf"^long line rank={rank} x{{140}}$", log, re.M), log
        assert re.search(r"UserWarning: under the bar w{120}$", log, re.M), log


def test_a_flood_of_updates_leaves_a_small_log(tmp_path):
    path = local_cluster(tmp_path, nodes=1)
    code, out, _ = ddp_up("--no-dashboard", str(path), BARS, "flood", "100000", timeout=90)
    assert code == 0, out
    log = run_dir(job_of(out)) / "rank0.log"
    assert log.stat().st_size < 4096, log.read_text()[:2000]  # not 1.9 MB of updates in one line
    assert "update 100000/100000\n" in log.read_text()
    assert sum("update " in line for line in out.splitlines()) <= 3, out


class Events(ThreadingHTTPServer):
    """A webhook on 127.0.0.1 that keeps every JSON body POSTed to it; POSTs to /fail... get a 500."""

    def __init__(self) -> None:
        self.got: list[dict] = []
        self.arrived = threading.Condition()
        super().__init__(("127.0.0.1", 0), Hook)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}{path}"

    def wait(self, predicate, timeout: float = 60.0) -> list[dict]:
        with self.arrived:
            assert self.arrived.wait_for(lambda: predicate(self.got), timeout), self.got
            return list(self.got)


class Hook(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path.startswith("/fail"):
            self.send_response(500)
            self.end_headers()
            return
        with self.server.arrived:
            self.server.got.append(dict(body, path=self.path))
            self.server.arrived.notify_all()
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def events():
    server = Events()
    yield server
    server.shutdown()
    server.server_close()


TOKEN = "T0ken5ecret4242"  # as a webhook's token path segment (Slack's, Discord's) is


def test_every_target_hears_a_restart_and_the_end_and_a_failing_one_is_told_once(tmp_path, events):
    told = tmp_path / "told.jsonl"
    path = local_cluster(tmp_path, restarts=1, restart_delay=0.5, stop_grace=1,
                         notify=[{"webhook": events.url("/hook")},
                                 {"command": f"cat >> {shlex.quote(str(told))}", "on": ["ended"]},
                                 {"webhook": events.url(f"/fail/{TOKEN}")},
                                 f"json://127.0.0.1:{events.server_address[1]}/apprise"])
    code, out, _ = ddp_up("--no-dashboard", str(path), SCRIPT, "tick", "3", "0.2", "1", "7", "0", timeout=120)
    assert code == 0, out  # attempt 0 failed, attempt 1 succeeded: the failing target changed nothing
    got = events.wait(lambda got: sum(e["path"] == "/hook" for e in got) >= 2
                      and sum(e["path"] == "/apprise" for e in got) >= 2)
    hook = [e for e in got if e["path"] == "/hook"]
    assert [e["event"] for e in hook] == ["restart", "ended"], hook
    assert "exited with code 7" in hook[0]["root_cause"] and hook[0]["attempt"] == 1
    assert hook[1]["ok"] is True and hook[1]["exit_code"] == 0 and hook[1]["attempts"] == 2
    apprise = [e for e in got if e["path"] == "/apprise"]
    assert apprise[-1]["title"].endswith(": ended") and "ok after" in apprise[-1]["message"]
    lines = [json.loads(line) for line in told.read_text().splitlines()]
    assert [e["event"] for e in lines] == ["ended"]  # `on: [ended]`
    assert out.count("notify[2] (webhook) failed: HTTP Error 500") == 1, out  # told once, for two events
    assert TOKEN not in out  # a target's token (here a path segment) is a secret; its host is not
    assert TOKEN not in (run_dir(job_of(out)) / "cluster.yaml").read_text()


def test_a_detached_job_tells_its_end_from_its_node(tmp_path, events):
    path = local_cluster(tmp_path, notify=[{"webhook": events.url("/hook")}])
    code, out, _ = ddp_up("--detach", str(path), SCRIPT, "tick", "4", "0.5", "1", "3", timeout=60)
    assert code == 0, out
    got = events.wait(lambda got: any(e["event"] == "ended" for e in got), timeout=90)
    ended = next(e for e in got if e["event"] == "ended")
    assert ended["detached"] is True and ended["ok"] is False, ended
    assert "exit code" in ended["root_cause"] and ended["job_id"] == job_of(out)
    done = subprocess.run([sys.executable, "-c", "from orchestrator.commands.entry import kill; kill()", str(path), "--job",
                           job_of(out), "--purge"], cwd=REPO, capture_output=True, timeout=60)  # its record too
    assert done.returncode == 0, done.stdout


def test_the_run_records_the_command_the_cluster_file_and_the_checkout(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    git = ["git", "-C", str(src), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (src / "train.py").write_text("print('v1')\n")
    subprocess.run([*git, "add", "train.py"], check=True)
    subprocess.run([*git, "commit", "-qm", "v1"], check=True)
    commit = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    (src / "train.py").write_text("print('v2')\n")  # uncommitted
    (src / "notes.txt").write_text("untracked\n")
    work = tmp_path / "work"  # a local node's workdir is else ddp-up's own (the checkout running the tests)
    work.mkdir()
    path = runner.local_cluster(tmp_path, sync={"src": str(src)}, workdir=str(work),  # torchrun: torch is recorded
                                env={"OMP_NUM_THREADS": 1, "WANDB_API_KEY": "k3y-v4lue"})
    code, out, _ = ddp_up("--no-dashboard", str(path), "train.py", timeout=90)
    assert code == 0, out
    d = run_dir(job_of(out))
    record = json.loads((d / "run.json").read_text())
    assert record["git"]["commit"] == commit and record["git"]["dirty"] and record["git"]["untracked"] == ["notes.txt"]
    assert record["command"][-1] == "train.py" and record["versions"]["python"]
    assert "+print('v2')" in (d / "git.diff").read_text()
    assert "k3y-v4lue" not in (d / "cluster.yaml").read_text() and "WANDB_API_KEY" in (d / "cluster.yaml").read_text()
    nodes = json.loads((d / "summary.json").read_text())["nodes"]
    assert all(n["python"] and n["torch"] for n in nodes)
    assert (work / "train.py").read_text() == "print('v2')\n"  # the job ran the tree as it was, diff and all


def test_an_attach_shows_a_detached_jobs_bar_moving_between_the_journals_snapshots(tmp_path, tmux):
    """The journal keeps a bar every 10 s; a live attach shows the bars file beside it, rewritten
    every second, so the dashboard moves as for a job ddp-up runs."""
    path = local_cluster(tmp_path, nodes=1, launcher="none", stop_grace=3)
    code, out, _ = ddp_up("--detach", str(path), BARS, "hand", "60", "0.25", timeout=60)
    assert code == 0, out
    job = job_of(out)
    try:
        env = f"PYTHONPATH={shlex.quote(str(REPO))} COLUMNS= LINES="
        attach = "from orchestrator.commands.entry import attach; attach()"
        cmd = (f"cd {shlex.quote(str(tmp_path))} && env {env} {shlex.quote(sys.executable)} -c {shlex.quote(attach)} "
               f"--runs-dir {shlex.quote(RUNS_ROOT)} {path} {job}; sleep 60")
        tmux("new-session", "-d", "-s", "attach", "-x", "200", "-y", "40", cmd)
        seen: set[str] = set()
        row = re.compile(r"^\s*0\s+local-0\s+0\s+running\s.*?step\s+(\d+)%", re.M)

        def moving():
            found = row.search(tmux("capture-pane", "-p", "-t", "attach"))
            if found:
                seen.add(found.group(1))
            return len(seen) >= 3  # three values within 10 s: not the journal's one snapshot

        assert procs.wait_for(moving, timeout=10, interval=0.2), (seen, tmux("capture-pane", "-p", "-t", "attach"))
    finally:
        code, out = ddp_kill(str(path), "--purge")  # its own jobs (--all: a parallel test worker's too)
        assert code == 0, out
