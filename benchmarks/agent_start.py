"""The node agent's start cost: CPU ms from `python -S -c STUB` (the loader on stdin) to its first answer, this
build against another checkout's, interleaved in one run.

    python3 -m benchmarks.agent_start [--baseline DIR] [--runs 30]

Each run starts the agent as a transport does (the bootstrap arguments, then the shipped modules
and their bytecode on stdin) with a DetectSpec, the smallest mode: what it costs is the
interpreter, unpacking and running the shipped modules, and one answer. CPU is the agent's own
(user + system, from wait4), so the machine's load does not count; medians, with min-max.
Every node pays this once per launch (and once more per one-shot call), N times on a simulated
cluster that shares these 2 cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]

# Run in the checkout being measured: its bootstrap arguments and its hello for a DetectSpec.
HELLO = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
if os.path.exists(os.path.join(sys.argv[1], "orchestrator", "remote", "protocol.py")):
    from orchestrator.remote import protocol
else:  # a build from before the stage packages
    from orchestrator import protocol
if os.path.exists(os.path.join(sys.argv[1], "orchestrator", "node", "protocol", "wire.py")):
    from orchestrator.node.protocol import wire
elif os.path.exists(os.path.join(sys.argv[1], "orchestrator", "node", "wire.py")):  # before the node's rooms
    from orchestrator.node import wire
else:  # a build from before the node package (an import attempt could find this checkout's instead)
    from orchestrator import wire
sys.stdout.buffer.write(json.dumps(protocol.bootstrap_args()).encode() + b"\n")
sys.stdout.buffer.write(b"".join(protocol.hello(wire.DetectSpec(env={}))))
"""


def prepare(tree: Path) -> tuple[list[str], bytes]:
    """(the agent's arguments, its stdin) as ``tree``'s controller would send them."""
    out = subprocess.run([sys.executable, "-c", HELLO, str(tree)], check=True, capture_output=True).stdout
    first, _, rest = out.partition(b"\n")
    import json

    return json.loads(first), rest


def one_start(args: list[str], data: bytes) -> float:
    """CPU seconds of one agent, from its start to its exit after the answer."""
    with tempfile.TemporaryFile() as stdin:
        stdin.write(data)
        stdin.seek(0)
        proc = subprocess.Popen([sys.executable, "-u", *args], stdin=stdin, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
        answer = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0 or not answer.startswith(b"Detected"):
        raise SystemExit(f"the agent did not answer (status {proc.returncode}): {answer[:200]!r}")
    return usage.ru_utime + usage.ru_stime


def shipped_modules(data: bytes) -> int:
    """How many modules ``data`` (an agent's stdin) ships: the header's list (after the loader, where
    a loader comes first: its size on a line, then its source)."""
    first, _, rest = data.partition(b"\n")
    if first.isdigit():
        rest = rest[int(first):]
        first, _, rest = rest.partition(b"\n")
    words = first.split()
    return len(words[2].split(b",")) if len(words) > 2 else 0


def summary(times: list[float]) -> str:
    ms = [t * 1000 for t in times]
    return f"{statistics.median(ms):.1f} ({min(ms):.1f}-{max(ms):.1f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", type=Path, help="another checkout of ddp-up to compare with")
    p.add_argument("--runs", type=int, default=30)
    args = p.parse_args()
    trees = {"this build": HERE} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    prepared = {name: prepare(tree) for name, tree in trees.items()}
    times: dict[str, list[float]] = {name: [] for name in trees}
    for _ in range(args.runs):
        for name, (argv, data) in prepared.items():  # interleaved: drift hits both alike
            times[name].append(one_start(argv, data))
    print(f"| build | modules shipped | bytes shipped | agent start, CPU ms, median (min-max) of {args.runs} |")
    print("|---|---|---|---|")
    for name, (argv, data) in prepared.items():
        modules = shipped_modules(data)
        print(f"| {name} | {modules} | {len(data):,} | {summary(times[name])} |")
    if args.baseline:
        ratios = [a / b for a, b in zip(times["this build"], times["baseline"])]
        print(f"\nthis build / baseline: {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
