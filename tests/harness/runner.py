"""Run the real ddp-up / ddp-kill CLIs as subprocesses and watch their output as it arrives."""

from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.harness import procs

REPO = Path(__file__).resolve().parents[2]
# Run logs of every test launch go here (not into the checkout), removed when the tests end.
RUNS_ROOT = tempfile.mkdtemp(prefix="ddp-up-test-runs-")
atexit.register(shutil.rmtree, RUNS_ROOT, True)
# The console entry points, as `ddp-up` runs them (signals recorded before anything is imported).
UP = "from orchestrator.commands.entry import up; up()"
KILL = "from orchestrator.commands.entry import kill; kill()"
CHECK = "from orchestrator.commands.entry import check; check()"
FETCH = "from orchestrator.commands.entry import fetch; fetch()"


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDP_UP_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["COLUMNS"] = "200"  # keep rich from wrapping summary tables in captured output
    return env


class Launch:
    """A running ddp-up; output is collected by a thread so waits can be on lines, not sleeps."""

    def __init__(self, args: list[str], code: str = UP, prefix: tuple[str, ...] = (), env: dict | None = None):
        """``prefix``: a command that runs the CLI (``salloc -N3``), which then starts in a session
        of its own, as a terminal's foreground job; ``env``: more environment variables."""
        if code == UP:
            args = ["--runs-dir", RUNS_ROOT, *args]
        self.proc = subprocess.Popen([*prefix, sys.executable, "-c", code, *args], cwd=REPO, env={**_env(), **(env or {})},
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, start_new_session=bool(prefix),
                                     stderr=subprocess.STDOUT, text=True, encoding="utf-8", errors="replace")
        self.lines: list[str] = []
        if procs.SCOPE is not None:  # its jobs are the test's (its leak check counts them)
            procs.SCOPE.texts.append(lambda: " ".join(map(str, args)) + "\n" + self.output)
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.started = time.monotonic()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    @property
    def output(self) -> str:
        with self._changed:
            return "\n".join(self.lines)

    def wait_line(self, pattern: str, timeout: float) -> str:
        """Block until an output line matches ``pattern`` (regex); fail with the output so far."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        with self._changed:
            while True:
                for line in self.lines[seen:]:
                    if rx.search(line):
                        return line
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(f"no line matching {pattern!r} within {timeout} s:\n{self.output}")
                self._changed.wait(min(left, 0.5))

    def signal(self, sig: int = signal.SIGINT) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
            raise AssertionError(f"ddp-up did not exit within {timeout} s:\n{self.output}") from None
        self._reader.join(5)
        return code

    @property
    def job_id(self) -> str:
        m = re.search(r"job (\d{8}-\d{6}-\w+)", self.output)
        assert m, f"no job id in output:\n{self.output}"
        return m.group(1)


def run_dir(job_id: str) -> Path:
    return Path(RUNS_ROOT) / job_id


def ddp_up(*args: str, timeout: float = 120) -> tuple[int, str, float]:
    """Run ddp-up to completion: (exit status, combined output, seconds)."""
    launch = Launch(list(args))
    code = launch.wait(timeout)
    return code, launch.output, time.monotonic() - launch.started


def ddp_kill(*args: str, timeout: float = 60) -> tuple[int, str]:
    launch = Launch(list(args), code=KILL)
    return launch.wait(timeout), launch.output


def ddp_check(*args: str, timeout: float = 60) -> tuple[int, str]:
    launch = Launch(list(args), code=CHECK)
    return launch.wait(timeout), launch.output


def local_cluster(tmp_path: Path, nodes: int = 2, gpus: int = 1, **top) -> Path:
    """A cluster file of ``nodes`` `transport: local` nodes (the same agent, relay and controller
    path as over SSH, at a fraction of the cost) in ``tmp_path``; ``top``: more top-level keys."""
    import yaml

    data = {"transport": "local", "python": sys.executable, "workdir": str(tmp_path), "env": {"OMP_NUM_THREADS": 1},
            "orphan_timeout": 30, "report": False,  # its page costs a run 0.2 s of CPU: the tests of it ask for it
            "metrics": False,  # reading every line for metrics: ~10 µs a line of CPU; the tests of it ask for it
            "nodes": [{"host": f"local-{i}", "gpus": gpus} for i in range(nodes)], **top}
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(data))
    return path
