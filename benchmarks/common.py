"""What the benchmarks share: the manual baseline (plain parallel ssh), timing a command with its
own rusage, and median (min-max) formatting."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import shlex
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tests.harness.runner import _env
from tests.harness.sshcluster import Node, SSHCluster, available

# The job's environment in every benchmark, baseline or not (the process-group timeout is long
# enough for 64 ranks on 2 cores, where the last one finishes importing torch a minute late).
JOB_ENV = {"OMP_NUM_THREADS": "1", "JOB_PG_TIMEOUT": "600"}
SCRIPT = str(Path(__file__).resolve().parents[1] / "tests" / "scripts" / "job.py")


@dataclass(frozen=True)
class Sample:
    wall: float  # seconds from start to exit
    cpu: float  # user+system seconds of the command and every child it waited for
    max_rss_mb: float  # the largest resident set among them
    code: int
    output: str
    lines_at: float | None = None  # seconds from start until ``lines`` (timed's) had all appeared


def timed(argv: list[str], timeout: float, lines: tuple[str, int] | None = None, **popen) -> Sample:
    """Run argv to the end; its rusage comes from wait4, so nothing else on the machine counts.
    ``lines``: (a pattern, a count): when that many output lines matching it had appeared."""
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, **popen)
    def kill() -> None:  # the command and every child it left (the manual way leaves ssh clients)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    timer = threading.Timer(timeout, kill)
    timer.start()
    pattern, wanted = (re.compile(lines[0]), lines[1]) if lines else (None, 0)
    seen, lines_at, chunks = 0, None, []
    try:
        for line in proc.stdout:
            chunks.append(line)
            if pattern is not None and lines_at is None:
                # every match, not every line: the manual way's ssh clients share one pipe, and an
                # unbuffered rank writes its text and its newline apart, so two lines can share one
                seen += len(pattern.findall(line.decode(errors="replace")))
                lines_at = time.monotonic() - t0 if seen >= wanted else None
        out = b"".join(chunks)
        _, status, usage = os.wait4(proc.pid, 0)
    except BaseException:
        kill()
        raise
    finally:
        timer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here; keep Popen from waiting again
    return Sample(time.monotonic() - t0, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024,
                  proc.returncode, out.decode(errors="replace"), lines_at)


def compile_like_pip(tree: Path | None = None) -> None:
    """Bytecode for the package, as `pip install` writes it. An editable install leaves that to
    the first import, which never happens where PYTHONDONTWRITEBYTECODE is set (as on these
    machines): every ddp-up run would compile its modules again, 0.15 s of CPU that an installed
    ddp-up does not pay (measured: importing the CLI, 0.31 s without bytecode, 0.15 s with)."""
    import compileall

    compileall.compile_dir(str((tree or Path(__file__).resolve().parents[1]) / "orchestrator"), quiet=1)


def env_for(tree: Path | None) -> dict:
    """The environment that runs ``tree``'s ddp-up (this checkout's where None)."""
    env = _env()
    if tree is not None:
        env["PYTHONPATH"] = str(tree) + os.pathsep + os.environ.get("PYTHONPATH", "")
    return env


def cluster_args(doc: str, nodes: str, more=None, baseline: bool = False) -> argparse.Namespace:
    """--nodes (a list of cluster sizes, as ``args.sizes``) and --repeat, --baseline where the
    benchmark times another checkout too, plus what ``more(parser)`` adds; exits 2 where this
    machine cannot host the namespace cluster."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--nodes", default=nodes, help="comma-separated node counts")
    p.add_argument("--repeat", type=int, default=3)
    if baseline:
        p.add_argument("--baseline", type=Path, metavar="DIR",
                       help="another checkout of ddp-up (a previous build), timed in the same run, interleaved")
    if more is not None:
        more(p)
    args = p.parse_args()
    if reason := available():
        sys.exit(f"cannot run: {reason}")
    compile_like_pip()
    if getattr(args, "baseline", None) is not None:
        args.baseline = args.baseline.resolve()
        compile_like_pip(args.baseline)
    args.sizes = [int(n) for n in args.nodes.split(",")]
    return args


def spread(values: list[float], fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def ssh_argv(cluster: SSHCluster, node: Node, remote: str, tty: bool = False) -> list[str]:
    """How a person reaches a node by hand: OpenSSH, key auth, the cluster's known_hosts."""
    return ["ssh", "-i", str(cluster.client_key), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
            "-o", f"UserKnownHostsFile={cluster.known_hosts}", "-o", "ConnectTimeout=10",
            *(["-tt"] if tty else []), f"root@{node.addr}", remote]


def torchrun_line(nodes: list[Node], k: int, port: int, workdir: str, tag: str, script_args: list[str],
                  nproc: int = 1, script: str = SCRIPT) -> str:
    """The launcher line a user types on node k. The ddp-up tag is set only so the benchmark can
    count (and finally clean up) the baseline's processes; nothing in the launch reads it."""
    argv = [sys.executable, "-u", "-m", "torch.distributed.run", f"--nnodes={len(nodes)}", f"--nproc-per-node={nproc}",
            f"--node-rank={k}", f"--master-addr={nodes[0].addr}", f"--master-port={port}", script, *script_args]
    env = " ".join(f"{name}={value}" for name, value in JOB_ENV.items()) + f" DDP_UP_JOB={tag} DDP_UP_NODE={k}"
    return f"cd {shlex.quote(workdir)} && exec env {env} {shlex.join(argv)}"


def parallel_ssh_script(cluster: SSHCluster, nodes: list[Node], remote_of, tty: bool = False,
                        trap: bool = False, feed: str = "") -> str:
    """The manual way, scripted: one ``ssh node cmd &`` per node (each reading ``feed | `` when
    given), then ``wait`` for each."""
    lines = ["set -u", "pids=()"]
    if trap:  # the careful version: Ctrl-C takes the ssh clients down with the script
        lines.append("trap 'kill 0' INT TERM")
    for k, node in enumerate(nodes):
        pipe = f"{feed} | " if feed else ""
        lines.append(f"{pipe}{shlex.join(ssh_argv(cluster, node, remote_of(k), tty))} & pids+=($!)")
    lines += ["rc=0", 'for p in "${pids[@]}"; do wait "$p" || rc=1; done', "exit $rc"]
    return "\n".join(lines) + "\n"


class Watched:
    """A command in its own session (as a terminal's foreground job), its output read as it comes,
    so a benchmark can wait for lines instead of sleeping."""

    def __init__(self, argv: list[str], **popen):
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, **popen)
        self.text = ""
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for raw in self.proc.stdout:
            with self._changed:
                self.text += raw.decode(errors="replace")
                self._changed.notify_all()

    def wait_for(self, predicate, timeout: float) -> None:
        """Bounded wait until predicate(output so far) holds; fails with the output's tail."""
        with self._changed:
            if not self._changed.wait_for(lambda: predicate(self.text) or self.proc.poll() is not None, timeout) \
                    or not predicate(self.text):
                raise SystemExit(f"gave up waiting for {argv_name(self.proc.args)}:\n{self.text[-3000:]}")

    def ctrl_c(self) -> None:
        """What Ctrl-C in a terminal does: SIGINT to the whole foreground process group."""
        os.killpg(self.proc.pid, signal.SIGINT)

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def argv_name(argv) -> str:
    return " ".join(map(str, argv))[:80]
