"""What a run did over time, kept for its report: ``runs/<job>/timeline.jsonl``.

A view like the others (every event the console gets reaches it), it keeps for the run's whole
life: each rank's progress (its bar's count and rate) and lines per second, each GPU's utilization
and memory, each node's late time at the collectives and its states, and each attempt. It stays
bounded: a series keeps at most POINTS points; once full, its points are merged two by two and its
step doubles, so 24 hours of 512 ranks and 512 GPUs stay a few MB, and the early hours keep their
shape. The file is written whole (a new file, renamed over the old) every WRITE_EVERY seconds by a
thread of its own, never the job loop's, and at the run's end. A file without its last line
(``end``) was cut short, and the report says so.

One JSON object a line; times in seconds from the run's start (``started``, wall clock):

  {"kind": "run", "job", "started", "format": 1}                       first
  {"kind": "attempt", "attempt", "start", "end", "nodes", "world_size", "end_why", "cause", "next"}
  {"kind": "state", "t", "node", "state", "reason"}                    a node's state, as it changed
  {"kind": "progress", "rank", "node", "step", "total", "desc", "points": [[t, n, rate], ...]}
  {"kind": "lines", "rank", "node", "step", "points": [[t, lines a second], ...]}
  {"kind": "gpu", "node", "gpu", "total_mib", "step", "points": [[t, util %, used MiB], ...]}
  {"kind": "late", "node", "step", "points": [[t, late ms], ...]}
  {"kind": "end", "t", "exit_status"}                                  last, once the run ended
"""

from __future__ import annotations

import json
import math
import re
import os
import threading
import time

from ..config.masking import mask_values
from ..diagnose.progress import read
from ..ownfiles import no_link_open, own_dir

NAME = "timeline.jsonl"
POINTS = 150  # a series' most points
FIRST_STEP = 2.0  # seconds: a series' step until it fills
WRITE_EVERY = 30.0  # seconds between two writes while the run goes on
STATES_MOST = 20_000  # node state changes kept (a flapping node cannot grow the file without end)
DESC_MOST = 200  # characters of a bar's description kept


def bar_name(row: str) -> str:
    """A bar's name: its description without the numbers (before tqdm's ``NN%|``), so that every
    redraw, and every epoch of Lightning's ("Epoch 3"), is the same bar."""
    head = row.split("%|", 1)[0] if "%|" in row else row.split("|", 1)[0]
    return re.sub(r"[\d.]+", "#", head).rstrip(" :#").strip()[:80]


class Series:
    """One quantity over time, in buckets of ``step`` seconds: the mean of the samples in each
    (``total``: their sum, for counts), at most POINTS buckets; past that the step doubles."""

    def __init__(self, total: bool = False):
        self.total = total
        self.step = FIRST_STEP
        self.buckets: dict[int, list[float]] = {}  # bucket -> [count, sum of t, sum of each value...]

    def add(self, t: float, *values: float) -> None:
        if not all(map(math.isfinite, values)):
            return
        key = int(t // self.step)
        got = self.buckets.get(key)
        if got is None:
            got = self.buckets[key] = [0.0, 0.0] + [0.0] * len(values)
            if len(self.buckets) > POINTS:
                self.coarsen()
                got = self.buckets.setdefault(int(t // self.step), got)
        got[0] += 1
        got[1] += t
        for i, v in enumerate(values):
            got[2 + i] += v

    def coarsen(self) -> None:
        self.step *= 2
        merged: dict[int, list[float]] = {}
        for key, got in self.buckets.items():
            into = merged.setdefault(key // 2, [0.0] * len(got))
            for i, v in enumerate(got):
                into[i] += v
        self.buckets = merged

    def points(self, origin: float) -> list[list[float]]:
        """[[t - origin, value...]]: each bucket's mean (a count's: per second)."""
        out = []
        for key, (count, t, *sums) in sorted(self.buckets.items()):
            if not count:
                continue
            when = (key + 0.5) * self.step if self.total else t / count
            out.append([round(when - origin, 1)] + [round(s / self.step if self.total else s / count, 3) for s in sums])
        return out


class Timeline:
    """The recorder (see above) for ``plan``'s run, written into ``where``."""

    def __init__(self, where: str, plan, wall=time.time, replay: bool = False):
        self.where, self.plan, self.wall, self.replay = where, plan, wall, replay
        self.started = wall()
        self.recorded = None  # ``replay``: () -> the frame in hand's own time (or None), in place of now
        self.lock = threading.Lock()
        self.series: dict[tuple, Series] = {}
        self.about: dict[tuple, dict] = {}  # a series' own fields (its node, total, description)
        self.states: list[dict] = []
        self.attempts: list[dict] = []
        self.ended: dict | None = None
        self.broken: str | None = None
        self.wake = threading.Event()
        self.attempt(plan)
        self.writer = threading.Thread(target=self.keep_writing, name="timeline", daemon=True)
        self.writer.start()

    def at(self, when: float | None = None) -> float:
        """When something happened (wall clock): ``when``, else a replayed frame's own time, else now.
        The file's times count from the earliest (a replay's run began before the replay)."""
        if when is None and self.recorded is not None:
            when = self.recorded()
        when = self.wall() if when is None else when
        self.started = min(self.started, when)
        return when

    def sample(self, key: tuple, about: dict, t: float, *values: float, total: bool = False) -> None:
        with self.lock:
            series = self.series.get(key)
            if series is None:
                series = self.series[key] = Series(total)
            self.about[key] = about
            series.add(t, *values)

    # --- view protocol ------------------------------------------------------------------------

    def attempt(self, plan) -> None:
        self.plan = plan
        with self.lock:
            t = self.at()
            self.attempts.append({"kind": "attempt", "attempt": plan.attempt, "start": t, "end": None,
                                  "nodes": [n.label for n in plan.nodes], "world_size": plan.world_size})
            if not self.replay:  # a replay's nodes were connected long ago
                self.states += [{"kind": "state", "t": t, "node": n.label, "attempt": plan.attempt,
                                 "state": "connecting", "reason": None} for n in plan.nodes]

    def lines(self, node, lines) -> None:
        counts: dict[int, int] = {}
        for line in lines:
            if line.rank is not None and not line.more:
                counts[line.rank] = counts.get(line.rank, 0) + 1
        t = self.at()
        for rank, count in counts.items():  # a series a rank and node: a rank that moved is drawn where it ran
            self.sample(("lines", rank, node.label), {"rank": rank, "node": node.label}, t, count, total=True)

    def bars(self, node, bars, at: float | None = None) -> None:
        t = self.at(at)
        for bar in bars:
            reading = next((r for r in map(read, bar.rows) if r is not None), None)
            if reading is None:
                continue
            desc = bar.rows[0][:DESC_MOST] if bar.rows else ""
            # a series a bar: the HF Trainer's checkpoint writer ("Writing model shards") is not its training
            key = ("progress", bar.rank, node.label, bar_name(desc))
            self.sample(key, {"rank": bar.rank, "node": node.label, "total": reading.total, "unit": reading.unit,
                              "desc": desc, "bar": bar_name(desc)},
                        t, reading.n, reading.rate if reading.rate is not None else math.nan)

    def gpus(self, node, gpus, at: float | None = None) -> None:
        t = self.at(at)
        for gpu in gpus if isinstance(gpus, list) else ():
            if isinstance(gpu, list) and len(gpu) == 4 and all(isinstance(v, (int, float)) for v in gpu):
                self.sample(("gpu", node.label, gpu[0]), {"node": node.label, "gpu": gpu[0], "total_mib": gpu[3]},
                            t, gpu[1], gpu[2])

    def late(self, figures) -> None:
        t = self.at()
        for figure in figures:
            label = next((n.label for n in self.plan.nodes if n.index == figure.node), str(figure.node))
            self.sample(("late", label), {"node": label}, t, figure.late * 1000)

    def node_state(self, status) -> None:
        with self.lock:
            if len(self.states) < STATES_MOST:
                self.states.append({"kind": "state", "t": self.at(), "node": status.plan.label,
                                    "attempt": self.plan.attempt, "state": status.state, "reason": status.reason})

    def finished(self, result, exit_code: int | None = None, attempts=()) -> None:
        """The run ended: each attempt's end and cause, then the file, whole, with its last line."""
        with self.lock:
            records = {record.number: record for record in attempts}
            for kept in self.attempts:
                record = records.get(kept["attempt"])
                if record is not None:
                    kept.update(end=self.at(record.ended), end_why=record.end, cause=record.root_cause,
                                next=record.next)
                elif kept["end"] is None:
                    kept["end"] = self.at()
                seen = [s["t"] for s in self.states if s["attempt"] == kept["attempt"]]
                if self.replay and seen:  # its nodes' recorded words, not when the replay read them
                    kept["start"], kept["end"] = min(seen), max(seen)
            self.ended = {"kind": "end", "t": self.at(),
                          "exit_status": result.exit_code if exit_code is None else exit_code}
        self.close()

    def __enter__(self) -> Timeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Idempotent: the writer's thread ends, and the file is written as it stands."""
        self.wake.set()
        self.writer.join(10)
        self.write()

    # --- the file -----------------------------------------------------------------------------

    def keep_writing(self) -> None:
        while not self.wake.wait(WRITE_EVERY):
            self.write()

    def records(self) -> list[dict]:
        def relative(record: dict) -> dict:
            return {k: round(v - origin, 1) if k in ("t", "start", "end") and v is not None else v
                    for k, v in record.items()}

        with self.lock:
            origin = self.started
            out = [{"kind": "run", "job": self.plan.job_id, "started": origin, "format": 1}]
            out += [relative(r) for r in (*self.attempts, *self.states)]
            out += [dict(self.about[key], kind=key[0], step=series.step, points=series.points(origin))
                    for key, series in self.series.items()]
            out += [relative(self.ended)] if self.ended else []
        return mask_values(out, self.plan.secrets)

    def write(self) -> None:
        if self.broken is not None:
            return
        try:
            records = self.records()
            tmp = os.path.join(own_dir(self.where, private=True), f".{NAME}.tmp")
            with os.fdopen(no_link_open(tmp, fresh=True), "w", encoding="utf-8") as f:
                for record in records:
                    f.write(json.dumps(record, separators=(",", ":")) + "\n")
            os.replace(tmp, os.path.join(self.where, NAME))
        except (OSError, ValueError) as e:
            self.broken = str(e)  # the run logs' own writer says a runs dir that cannot be written
