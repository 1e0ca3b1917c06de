"""Detached jobs at 16 nodes: how fast --detach returns, how fast an attach shows lines, and what a
detached job's own supervision costs on its nodes.

    python3 -m benchmarks.detach [--nodes 16] [--repeat 3] [--backlog 100000]

On the namespace sshd cluster of the tests (Linux, root), `launcher: none`, one rank per node.
Per repeat:
  running   a normal ddp-up, from its start until every node runs (the job loop's own state, read
            by a view hook), against `ddp-up --detach` from its start to its exit;
  attach    a detached job whose ranks printed --backlog lines in all and then print a timestamped
            live line every 0.5 s: ddp-attach from its start to its first shown line, and to the
            first live line printed after it started (the backlog replayed, the tail reached).
            Baseline: the manual way, `ssh node tail -n +1 -f <the ranks' log files>` on every
            node at once, measured the same way;
  cost      the CPU the job's agents use (everything a detached job adds on a node: journal,
            relay of the live lines, heartbeats, the supervisor) over 20 s of the live phase, as
            a percentage of one core per node.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.common import JOB_ENV, SCRIPT, Watched, cluster_args, parallel_ssh_script, spread
from tests.harness import procs
from tests.harness.runner import KILL, REPO, UP, _env
from tests.harness.sshcluster import SSHCluster

ATTACH = "from orchestrator.commands.entry import attach; attach()"
TIMEOUT = 300
COST_WINDOW = 20.0
# ddp-up as its console entry point runs it, with a view hook that prints when every node runs.
UP_UNTIL_RUNNING = """
import sys
from orchestrator.views import console
nodes, seen, shown = int(sys.argv[1]), set(), console.ConsoleView.node_state
def node_state(self, status):
    shown(self, status)
    if status.state == "running":
        seen.add(status.plan.index)
        if len(seen) == nodes:
            print("ALL-RUNNING", flush=True)
console.ConsoleView.node_state = node_state
sys.argv[1:] = sys.argv[2:]
from orchestrator.commands.entry import up
up()
"""


def cluster_file(cluster: SSHCluster, tmp: Path, n: int) -> Path:
    return cluster.cluster_file(tmp / f"c{n}.yaml", [(node, 1) for node in cluster.nodes[:n]], python=sys.executable,
                                workdir=str(tmp), env=JOB_ENV, launcher="none", ssh={"connect_timeout": 30})


def until(watched: Watched, predicate, timeout: float = TIMEOUT) -> float:
    """Seconds from the command's start until ``predicate(output)`` holds."""
    t0 = watched.started
    watched.wait_for(predicate, timeout)
    return time.monotonic() - t0


def watched(argv: list[str]) -> Watched:
    w = Watched(argv, cwd=REPO, env=_env())
    w.started = time.monotonic()
    return w


def to_running(path: Path, n: int, runs: Path) -> float:
    w = watched([sys.executable, "-c", UP_UNTIL_RUNNING, str(n), "--no-dashboard", "--runs-dir", str(runs),
                 str(path), SCRIPT, "tick", "1", "0"])
    seconds = until(w, lambda text: "ALL-RUNNING" in text)
    if w.wait(TIMEOUT) != 0:
        raise SystemExit(f"ddp-up failed:\n{w.text[-3000:]}")
    return seconds


def detach(path: Path, runs: Path, *job: str) -> tuple[float, str]:
    w = watched([sys.executable, "-c", UP, "--detach", "--runs-dir", str(runs), str(path), SCRIPT, *job])
    code = w.wait(TIMEOUT)
    seconds = time.monotonic() - w.started
    m = re.search(r"job (\S+) runs detached", w.text)
    if code != 0 or not m:
        raise SystemExit(f"ddp-up --detach failed:\n{w.text[-3000:]}")
    return seconds, m.group(1)


class FirstLines:
    """A command's output, read line by line in a thread of its own, noting when the first line
    that matches each pattern arrived (a check per line: 100k lines must not be re-scanned)."""

    def __init__(self, argv: list[str], patterns: dict[str, callable]):
        self.patterns = patterns
        self.seen: dict[str, float] = {}
        self.done = threading.Event()
        self.started = time.monotonic()
        self.proc = subprocess.Popen(argv, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.tail: list[bytes] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.tail = (self.tail + [line])[-20:]
            for name, matches in self.patterns.items():
                if name not in self.seen and matches(line):
                    self.seen[name] = time.monotonic() - self.started
            if len(self.seen) == len(self.patterns):
                self.done.set()
        self.done.set()

    def times(self, timeout: float = TIMEOUT) -> dict[str, float]:
        if not self.done.wait(timeout) or len(self.seen) < len(self.patterns):
            raise SystemExit("gave up waiting for the lines:\n" + b"".join(self.tail).decode(errors="replace"))
        return self.seen

    def stop(self) -> None:
        """Ctrl-C, as a terminal sends it to the foreground group; SIGKILL if it does not end."""
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def attach_times(argv: list[str]) -> tuple[float, float]:
    """Seconds to the first rank line shown, and to the first live line printed after the start."""
    start_wall = time.time()
    live = re.compile(rb"live t=([\d.]+)")

    def after_start(line: bytes) -> bool:
        m = live.search(line)
        return bool(m) and float(m.group(1)) >= start_wall

    reader = FirstLines(argv, {"first": lambda line: b"backlog " in line or b"live " in line, "tail": after_start})
    try:
        seen = reader.times()
    finally:
        reader.stop()
    return seen["first"], seen["tail"]


def agents_cpu(job: str) -> float:
    """CPU seconds used so far by the job's agents (the processes of its tags that run the agent)."""
    total = 0.0
    for p in procs.job_processes(job):
        try:
            cmd = Path(f"/proc/{p['pid']}/cmdline").read_bytes()
            if b"'ddp_up_agent';" not in cmd:
                continue
            fields = Path(f"/proc/{p['pid']}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except OSError:
            continue
    return total


def quiet(timeout: float = 60) -> None:
    left = procs.wait_no_job_processes(None, timeout)
    if left:
        raise SystemExit(f"job processes still running after {timeout} s: {left}")


def wait_files(where: Path, n: int, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while len(list(where.glob("done.*"))) < n:
        if time.monotonic() > deadline:
            raise SystemExit(f"the backlog was not printed within {timeout} s")
        time.sleep(0.2)


def manual_tail(cluster: SSHCluster, n: int, job: str) -> list[str]:
    """Every node's ranks' log files, from their first line, followed: what a person types."""
    def remote(k: int) -> str:
        logs = f"/tmp/ddp-up-0/{shlex.quote(job)}/node{k}/logs"
        return f"exec tail -q -n +1 -f $(find {logs} -name stdout.log)"
    # a terminal each (-tt): the remote tail -f gets SIGHUP when its ssh ends, as at a person's terminal
    return ["bash", "-c", parallel_ssh_script(cluster, cluster.nodes[:n], remote, tty=True)]


def main() -> None:
    args = cluster_args(__doc__, "16", lambda p: p.add_argument("--backlog", type=int, default=100_000))
    n = args.sizes[0]
    with tempfile.TemporaryDirectory(prefix="ddp-up-bench-") as tmp_name:
        tmp = Path(tmp_name)
        runs = tmp / "runs"
        cluster = SSHCluster(n, tmp / "cluster")
        cluster.up()
        path = cluster_file(cluster, tmp, n)
        rows: dict[str, list[float]] = {k: [] for k in ("running", "detach", "ratio", "first", "tail", "ssh first",
                                                         "ssh tail", "cost")}
        try:
            for r in range(args.repeat):
                timings = {}
                for way in (("running", "detach") if r % 2 == 0 else ("detach", "running")):  # order alternates
                    quiet()  # the previous job's processes are gone from the nodes (they share 2 cores)
                    timings[way] = to_running(path, n, runs) if way == "running" else \
                        detach(path, runs, "tick", "1", "0")[0]
                running, returned = timings["running"], timings["detach"]
                quiet()
                rows["running"].append(running), rows["detach"].append(returned)
                rows["ratio"].append(returned / running)
                marks = tmp / f"marks{r}"
                marks.mkdir()
                _, job = detach(path, runs, "backlog", str(args.backlog // n), "120", str(marks))
                wait_files(marks, n)
                first, tail = attach_times([sys.executable, "-c", ATTACH, "--no-dashboard", "--runs-dir", str(runs),
                                            str(path), job])
                ssh_first, ssh_tail = attach_times(manual_tail(cluster, n, job))
                cpu0, t0 = agents_cpu(job), time.monotonic()
                time.sleep(COST_WINDOW)  # the measured window itself: nothing to wait for
                cost = (agents_cpu(job) - cpu0) / (time.monotonic() - t0) / n * 100
                for key, value in (("first", first), ("tail", tail), ("ssh first", ssh_first),
                                   ("ssh tail", ssh_tail), ("cost", cost)):
                    rows[key].append(value)
                print(f"repeat {r}: running {running:.2f} s, --detach {returned:.2f} s; attach first {first:.2f} s, "
                      f"tail {tail:.2f} s (ssh tail -f: {ssh_first:.2f}, {ssh_tail:.2f}); agents {cost:.2f}% "
                      "of a core per node", flush=True)
                Watched([sys.executable, "-c", KILL, str(path), "--job", job, "--purge"], cwd=REPO,
                        env=_env()).wait(TIMEOUT)
        finally:
            Watched([sys.executable, "-c", KILL, str(path), "--all", "--purge"], cwd=REPO, env=_env()).wait(TIMEOUT)
            cluster.down()
    print(f"\n{n} nodes, 1 rank each, launcher none; backlog {args.backlog:,} lines; median (min-max) of "
          f"{args.repeat}, seconds\n")
    print("| what | ddp-up | baseline | ratio |")
    print("|---|---|---|---|")
    print(f"| --detach returns / a normal run reaches running | {spread(rows['detach'])} | {spread(rows['running'])} | "
          f"{spread(rows['ratio'])} |")
    print(f"| ddp-attach: first line / ssh tail -f | {spread(rows['first'])} | {spread(rows['ssh first'])} | - |")
    print(f"| ddp-attach: live tail reached / ssh tail -f | {spread(rows['tail'])} | {spread(rows['ssh tail'])} | - |")
    print(f"| a detached job's agents, % of a core per node | {spread(rows['cost'])} | - | - |")


if __name__ == "__main__":
    main()
