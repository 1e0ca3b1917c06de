"""What reading metrics costs: per line, against the relay's own cost per line; and the page of a
long run with metrics, its size and the time to make it.

    python3 -m benchmarks.metrics [--lines 200000] [--repeat 3] [--ranks 512] [--hours 24]

1. Per line, on the controller: the lines a training job prints (the README's demo, the HF
   Trainer's logs, Lightning's and tqdm's bars, torch's warnings, plain text), each read by
   diagnose/metrics.MetricReader; against the relay's own per-line work on the controller (a
   LogLine made and written to the rank's log file by views/logfiles, as a run does). Both in
   microseconds a line, the minimum of the repeats; the reader runs on a thread of its own.
2. The page: metrics.csv of a run of --ranks ranks over --hours hours (a loss and a learning rate,
   each rank a value every 30 s, thinned as metricsfile keeps them), its timeline, then
   report.html made from them: the file's and the page's sizes, and the seconds it took.
No cluster needed.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import tempfile
import time

from orchestrator.diagnose.metrics import MetricReader
from orchestrator.views import metricsfile

LINES = [
    "step 1234 loss 2.4149",
    "{'loss': '1.385', 'grad_norm': '0.283', 'learning_rate': '3.75e-05', 'epoch': '0.25'}",
    "Epoch 1:  50%|#####     | 4/8 [00:01<00:01,  3.90it/s, v_num=0, train_loss=0.123]",
    "Epoch 2/2  ━━━━━━━━━━━━━━━━━━━━━━━━━━ 8/8 0:00:00 • 0:00:00 101.31it/s v_num: 0 train_loss: 0.090",
    "[W1206 18:40:17.270628460 socket.cpp:207] [c10d] The hostname of the client socket cannot be retrieved. err=-3",
    "rank 3/8 on gpu-a: all_reduce ok (36)",
    "Saving model checkpoint to out/checkpoint-400",
    "x" * 300,
]


def per_line(lines: int, repeat: int) -> tuple[float, float]:
    """(µs a line reading metrics, µs a line the relay writes to a rank log), each the minimum."""
    from orchestrator.job.events import LogLine

    texts = [LINES[i % len(LINES)] for i in range(lines)]
    reader = MetricReader()
    read_best = write_best = math.inf
    for _ in range(repeat):
        started = time.perf_counter()
        for text in texts:
            reader.read(text)
        read_best = min(read_best, time.perf_counter() - started)
        with tempfile.TemporaryDirectory() as tmp, open(os.path.join(tmp, "rank0.log"), "w", encoding="utf-8") as f:
            started = time.perf_counter()
            for text in texts:  # what the relay does with each line here: a LogLine, its text to the rank's log
                line = LogLine("out", 0, text)
                f.write(line.text + "\n")
            write_best = min(write_best, time.perf_counter() - started)
    return read_best / lines * 1e6, write_best / lines * 1e6


def long_run(where: str, ranks: int, hours: float) -> int:
    """metrics.csv and timeline.jsonl of a long run, as the run would have kept them; the rows."""
    started = 1_800_000_000.0
    rows = metrics_csv(where, ranks, hours, started)
    with open(os.path.join(where, "timeline.jsonl"), "w") as f:
        f.write(json.dumps({"kind": "run", "job": "long", "started": started, "format": 1}) + "\n")
        for attempt in range(3):
            f.write(json.dumps({"kind": "attempt", "attempt": attempt, "start": attempt * hours * 1200,
                                "end": (attempt + 1) * hours * 1200, "nodes": [], "world_size": ranks - 8 * (attempt == 1)}) + "\n")
    return rows


def metrics_csv(where: str, ranks: int, hours: float, started: float) -> int:
    """metrics.csv of a run of ``ranks`` ranks from ``started`` for ``hours``, 8 a node, a loss and a
    learning rate from each rank every 30 s, thinned as metricsfile keeps them; the rows."""
    rows = 0
    every = 30.0
    points = int(hours * 3600 / every)
    with open(os.path.join(where, metricsfile.NAME), "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(metricsfile.COLUMNS)
        for i in range(points):
            stride = 1 << max(0, i // metricsfile.SERIES_MOST)
            if i % stride:
                continue
            for rank in range(ranks):
                loss = 3.0 * math.exp(-i / points * 3) + 0.01 * (rank % 7)
                out.writerow([f"{started + i * every:.3f}", i * 3 // points, rank, f"node-{rank // 8:02d}", i * 10,
                              "loss", f"{loss:.5f}"])
                out.writerow([f"{started + i * every:.3f}", i * 3 // points, rank, f"node-{rank // 8:02d}", i * 10,
                              "learning_rate", f"{1e-4 * (1 - i / points):.3g}"])
                rows += 2
                if rows >= metricsfile.ROWS_MOST:
                    return rows
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lines", type=int, default=200_000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--ranks", type=int, default=512)
    p.add_argument("--hours", type=float, default=24.0)
    args = p.parse_args()
    read_us, write_us = per_line(args.lines, args.repeat)
    print(f"per line, on the controller ({args.lines} lines of {len(LINES)} kinds, minimum of {args.repeat}):")
    print(f"  {'reading metrics':<32} {read_us:8.2f} µs  (its own thread)")
    print(f"  {'the relay, to the rank log':<32} {write_us:8.2f} µs")
    print(f"  {'ratio':<32} {read_us / write_us:8.2f}")
    from orchestrator.views.report import make_report

    with tempfile.TemporaryDirectory() as tmp:
        rows = long_run(tmp, args.ranks, args.hours)
        started = time.perf_counter()
        page = make_report(tmp)
        took = time.perf_counter() - started
        print(f"\nthe page of a {args.hours:g}-hour run of {args.ranks} ranks with 2 metrics:")
        print(f"  metrics.csv {os.path.getsize(os.path.join(tmp, metricsfile.NAME)) / 1e6:.1f} MB, {rows:,} rows")
        print(f"  report.html {os.path.getsize(page) / 1e6:.1f} MB, made in {took:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
