"""Launch-to-exit at 16..250 nodes over the user's own ssh: ddp-up against pdsh and plain parallel ssh.

    python3 -m benchmarks.scale [--nodes 16,64,128,250] [--repeat 3] [--jump 64] [--baseline DIR]

On the namespace sshd cluster of the tests (Linux, root; `apt-get install pdsh`), a torch-free job
(`launcher: none`, one process per node, printing one line) launched three ways, interleaved within
each repeat:
  ddp-up     connect, ship the agent, preflight, go, relay the output, exit (ssh.client: openssh);
  pdsh       `pdsh -R ssh -f N -w HOSTS 'cd WORKDIR && python job.py'` (N: every node at once);
  ssh        one `ssh node 'cd WORKDIR && python job.py' &` per node, then `wait`.
All three read one ssh_config (aliases, key, known_hosts). With --jump N, N nodes sit behind one jump
host whose sshd keeps the default `MaxStartups 10:30:100`, and pdsh runs as `-f 10` (more is dropped
there), against ddp-up's default ssh.max_parallel of 10.

Controller CPU counts every process the command started, ssh clients and the ControlMaster processes
that OpenSSH detaches included: this script is their child subreaper, so orphans come back to it and
their rusage is summed from wait4. Peak RSS is the largest resident set among them (ddp-up: its own).
With --baseline DIR, another checkout's ddp-up (a previous build) runs the same job on the direct nodes
in every repeat, and this build's time is printed as a ratio to it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from benchmarks.common import SCRIPT, cluster_args, env_for, spread
from tests.harness.runner import REPO, UP
from tests.harness.sshcluster import SSHCluster

TIMEOUT = 900
PR_SET_CHILD_SUBREAPER = 36


@dataclass(frozen=True)
class Run:
    wall: float
    cpu: float  # user+system of every process the command started (reaped by us)
    rss_mb: float  # the largest resident set among them
    code: int
    output: str


class Reaper:
    """This process as the child subreaper: detached descendants (OpenSSH's ControlPersist masters)
    are reparented here, so their CPU is reaped and counted too."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise SystemExit("cannot become a child subreaper (prctl)")

    def run(self, argv: list[str], settle: float = 70.0, **popen) -> Run:
        """Run argv; then wait (up to ``settle`` s) for every descendant it left, reaping all."""
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, **popen)
        out: list[bytes] = []
        reader = threading.Thread(target=lambda: out.append(proc.stdout.read()), daemon=True)
        reader.start()
        cpu, rss, code, wall = 0.0, 0, None, None
        deadline = t0 + TIMEOUT
        while True:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                if time.monotonic() > deadline or (wall is not None and time.monotonic() > t0 + wall + settle):
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    deadline = float("inf")
                time.sleep(0.02)
                continue
            cpu += usage.ru_utime + usage.ru_stime
            rss = max(rss, usage.ru_maxrss)
            if pid == proc.pid:
                code, wall = os.waitstatus_to_exitcode(status), time.monotonic() - t0
                proc.returncode = code
        reader.join(10)
        return Run(wall, cpu, rss / 1024, code, b"".join(out).decode(errors="replace"))


class Bench:
    def __init__(self, cluster: SSHCluster, tmp: Path, jump: int):
        self.cluster, self.tmp, self.reaper = cluster, tmp, Reaper()
        self.jump_host = cluster.nodes[0] if jump else None
        self.behind = set(n.name for n in cluster.nodes[1:jump + 1]) if jump else set()
        self.config = tmp / "ssh_config"
        self.config.write_text(self._ssh_config())

    def _ssh_config(self) -> str:
        c = self.cluster
        blocks = [f"Host {n.name}\n  HostName {n.addr}\n"
                  + (f"  ProxyJump {self.jump_host.name}\n" if n.name in self.behind else "") for n in c.nodes]
        return "".join(blocks) + (f"Host *\n  User root\n  IdentityFile {c.client_key}\n"
                                  f"  UserKnownHostsFile {c.known_hosts}\n  GlobalKnownHostsFile /dev/null\n"
                                  "  BatchMode yes\n")

    def nodes(self, n: int, behind: bool) -> list[str]:
        pool = [x.name for x in self.cluster.nodes[1:]]
        return [h for h in pool if (h in self.behind) == behind][:n]

    def ddp_up(self, hosts: list[str], tree: Path | None = None) -> Run:
        path = self.tmp / f"c{len(hosts)}.yaml"
        path.write_text(yaml.safe_dump({
            "ssh": {"client": "openssh", "config_file": str(self.config), "connect_timeout": 60},
            "python": sys.executable, "workdir": str(self.tmp), "launcher": "none", "orphan_timeout": 300,
            "nodes": [{"host": h, "gpus": 1} for h in hosts]}, sort_keys=False))
        return self._ok(self.reaper.run([sys.executable, "-c", UP, "--no-dashboard",
                                         "--runs-dir", str(self.tmp / "runs"), str(path), SCRIPT, "env", "RANK"],
                                        cwd=tree or REPO, env=env_for(tree)), "ddp-up", len(hosts))

    def remote(self) -> str:
        return f"cd {self.tmp} && exec {sys.executable} -u {SCRIPT} env RANK"

    def pdsh(self, hosts: list[str], fanout: int) -> Run:
        env = {**os.environ, "PDSH_SSH_ARGS": f"-F {self.config} -x %h", "PDSH_SSH_ARGS_APPEND": ""}
        return self._ok(self.reaper.run(["pdsh", "-R", "ssh", "-f", str(fanout), "-w", ",".join(hosts),
                                         self.remote()], env=env), "pdsh", len(hosts))

    def parallel_ssh(self, hosts: list[str]) -> Run:
        lines = ["pids=()"] + [f"ssh -F {self.config} -T {h} '{self.remote()}' & pids+=($!)" for h in hosts]
        lines += ["rc=0", 'for p in "${pids[@]}"; do wait "$p" || rc=1; done', "exit $rc"]
        return self._ok(self.reaper.run(["bash", "-c", "\n".join(lines)]), "parallel ssh", len(hosts))

    @staticmethod
    def _ok(run: Run, what: str, n: int) -> Run:
        if run.code != 0 or run.output.count("ENV RANK=") != n:
            raise SystemExit(f"{what} at {n} nodes failed (exit status {run.code}):\n{run.output[-3000:]}")
        return run


def main() -> int:
    args = cluster_args(__doc__, nodes="16,64,128,250", more=lambda p: p.add_argument(
        "--jump", type=int, default=64, help="nodes behind one jump host (0: none)"), baseline=True)
    if not shutil.which("pdsh"):
        sys.exit("cannot run: needs pdsh (apt-get install pdsh)")
    direct = args.sizes
    size = 1 + max(max(direct), 0) + args.jump
    if size > 253:
        sys.exit(f"{size - 1} nodes do not fit in one /24: lower --nodes or --jump")
    results: dict[tuple[str, int], list[tuple[Run, Run, Run | None]]] = {}
    before: dict[int, list[tuple[Run, Run]]] = {}  # (this build, baseline), direct nodes
    with tempfile.TemporaryDirectory() as tmp:
        cluster = SSHCluster(size, Path(tmp) / "cluster")
        t0 = time.monotonic()
        cluster.up()
        print(f"  {size} sshd nodes up in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
        try:
            bench = Bench(cluster, Path(tmp), args.jump)
            if args.jump:
                limit_startups(cluster, cluster.nodes[0])
            for r in range(args.repeat):
                for n in direct:
                    hosts = bench.nodes(n, behind=False)
                    row = (bench.ddp_up(hosts), bench.pdsh(hosts, len(hosts)), bench.parallel_ssh(hosts))
                    results.setdefault(("direct", n), []).append(row)
                    progress(r, f"{n} nodes", row)
                    if args.baseline:
                        before.setdefault(n, []).append((row[0], bench.ddp_up(hosts, args.baseline)))
                if args.jump:
                    hosts = bench.nodes(args.jump, behind=True)
                    row = (bench.ddp_up(hosts), bench.pdsh(hosts, 10), None)
                    results.setdefault(("jump", args.jump), []).append(row)
                    progress(r, f"{args.jump} nodes behind a jump host", row)
        finally:
            cluster.down()
    report(results, args.repeat)
    if args.baseline:
        print(f"\nthis build against {args.baseline} (direct nodes, same repeat); median (min-max)")
        print(f"{'nodes':>5} {'this build s':>18} {'baseline s':>18} {'this/baseline':>18} {'CPU this s':>18} "
              f"{'CPU baseline s':>18}")
        for n, runs in before.items():
            print(f"{n:>5} {spread([a.wall for a, _ in runs]):>18} {spread([b.wall for _, b in runs]):>18} "
                  f"{spread([a.wall / b.wall for a, b in runs]):>18} {spread([a.cpu for a, _ in runs]):>18} "
                  f"{spread([b.cpu for _, b in runs]):>18}")
    return 0


def limit_startups(cluster: SSHCluster, jump) -> None:
    """sshd's default MaxStartups on the jump host (the cluster's nodes are set higher)."""
    path = cluster.run_dir / f"{jump.name}.sshd_config"
    path.write_text(path.read_text().replace("MaxStartups 200:30:400", "MaxStartups 10:30:100"))
    os.kill(int((cluster.run_dir / f"{jump.name}.pid").read_text()), signal.SIGHUP)


def progress(r: int, what: str, row) -> None:
    ours, pdsh, ssh = row
    print(f"  repeat {r + 1}, {what}: ddp-up {ours.wall:.2f} s, pdsh {pdsh.wall:.2f} s"
          + (f", ssh {ssh.wall:.2f} s" if ssh else ""), file=sys.stderr, flush=True)


def report(results, repeat: int) -> None:
    print(f"\nlaunch-to-exit of a torch-free job (launcher: none, 1 process per node), {repeat} runs; "
          "median (min-max); CPU: the controller's, ssh clients and masters included")
    print(f"{'nodes':>22} {'ddp-up s':>18} {'pdsh s':>18} {'ssh & wait s':>18} {'ddp-up/pdsh':>18} "
          f"{'ddp-up/ssh':>18} {'CPU ddp-up s':>18} {'CPU pdsh s':>18} {'CPU ssh s':>18} {'RSS ddp-up MB':>14}")
    for (kind, n), rows in results.items():
        label = f"{n}" if kind == "direct" else f"{n} behind 1 jump host"
        has_ssh = rows[0][2] is not None
        dash = f"{'-':>18}"
        print(f"{label:>22} {spread([o.wall for o, _, _ in rows]):>18} {spread([p.wall for _, p, _ in rows]):>18} "
              + (f"{spread([s.wall for _, _, s in rows]):>18} " if has_ssh else f"{dash} ")
              + f"{spread([o.wall / p.wall for o, p, _ in rows]):>18} "
              + (f"{spread([o.wall / s.wall for o, _, s in rows]):>18} " if has_ssh else f"{dash} ")
              + f"{spread([o.cpu for o, _, _ in rows]):>18} {spread([p.cpu for _, p, _ in rows]):>18} "
              + (f"{spread([s.cpu for _, _, s in rows]):>18} " if has_ssh else f"{dash} ")
              + f"{max(o.rss_mb for o, _, _ in rows):>14.0f}")


if __name__ == "__main__":
    sys.exit(main())
