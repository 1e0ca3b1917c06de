"""What a rank's hostile progress text costs the controller and the node: CPU seconds per MB for
the bar parser (progress.read, on the controller's loop) and the node's Screen, against ordinary
tqdm bars in the same run. The baseline is the same bytes through a plain ``bytes.split`` (what
reading lines costs at all).

    python3 -m benchmarks.hostile_bars [--mb 1] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from orchestrator.node.watch.screen import Screen
from orchestrator.diagnose.progress import read

ROW = 200  # characters a row, as tqdm's bars are at most in a wide terminal


def texts(size: int) -> dict[str, bytes]:
    normal = b"\rtrain: 45%|####5     | 450/1000 [00:12<00:15, 36.20it/s, loss=0.31]"
    return {
        "tqdm bars (reference)": normal * (size // len(normal)),
        "digit runs": (b"\r" + b"1" * (ROW - 2) + b"/") * (size // ROW),
        "one 1 MB digit run": b"\r" + b"9" * size,
        "broken clocks": (b"\r1/2 [" + b":" * (ROW - 10) + b"<:]") * (size // ROW),
        "cursor escapes": (b"\x1b[" + b"9" * 60 + b"A\x1b[99999999B") * (size // 80),
    }


def per_mb(work, data: bytes, repeat: int) -> float:
    runs = []
    for _ in range(repeat):
        t0 = time.process_time()
        work(data)
        runs.append((time.process_time() - t0) / (len(data) / 1e6))
    return statistics.median(runs)


def parse(data: bytes) -> None:
    for row in data.split(b"\r"):
        read(row.decode("utf-8", "replace"))


def screen(data: bytes) -> None:
    s = Screen(clock=lambda: 0.0)
    for i in range(0, len(data), 65536):  # the relay's reads
        s.feed(data[i:i + 65536])
        s.live()
    s.end()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=1.0)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    size = int(args.mb * 1e6)
    print("| text | split only (s/MB) | progress.read (s/MB) | Screen (s/MB) |\n|---|---|---|---|")
    for name, data in texts(size).items():
        base = per_mb(lambda d: d.split(b"\r"), data, args.repeat)
        print(f"| {name} | {base:.4f} | {per_mb(parse, data, args.repeat):.4f} | {per_mb(screen, data, args.repeat):.4f} |")


if __name__ == "__main__":
    main()
