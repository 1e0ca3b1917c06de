"""What the run learned, kept as it goes: ``runs/<job>/metrics.csv``, one row a value.

A view like the others: every line a rank prints, and every progress bar it draws (Lightning's
and tqdm's postfix: ``loss=0.123``), reaches it. The job loop only hands them over: a thread of
its own reads them (diagnose/metrics.py) and appends the rows, so a flood of lines, or a slow
pattern of the cluster file's, never holds up the loop that sends heartbeats and handles signals.
What it cannot keep up with is counted and said, as is what the bounds leave out.

    time,attempt,rank,node,step,name,value
    1765044215.271,0,0,gpu-a,3,loss,6.4149

``time``: wall clock (Unix seconds) when ddp-up read the line; ``step``: the step the line names
(``step``, ``global_step``, ``iteration``, HF's ``epoch``), else its bar's count, else empty.
Readable as it is: ``pandas.read_csv("metrics.csv")``. Masked like every other record.
"""

from __future__ import annotations

import csv
import os
import queue
import threading
import time

from ..diagnose.metrics import MetricReader, patterns_of
from ..ownfiles import no_link_open

NAME = "metrics.csv"
COLUMNS = ("time", "attempt", "rank", "node", "step", "name", "value")
NAMES_MOST = 100  # distinct metric names a run keeps
SERIES_MOST = 20_000  # values of one name and rank kept at full rate; past that every 2nd, then every 4th...
ROWS_MOST = 2_000_000  # rows of the file, whatever the names and ranks
BACKLOG = 2_000  # batches of lines waiting for the reader; past that, lines are not read for metrics
FLUSH_EVERY = 1.0  # seconds: the file is flushed at least this often while values come


class MetricsFile:
    """The metrics of ``plan``'s run (diagnose/metrics.py's reader, with ``plan.metrics``'s
    patterns), appended to ``where``/metrics.csv by a thread of its own."""

    def __init__(self, where: str, plan, wall=time.time):
        self.plan, self.wall = plan, wall
        self.recorded = None  # a replay's: () -> the frame in hand's own time (or None), in place of now
        self.reader = MetricReader(patterns_of(plan.metrics or ()))
        self.path = os.path.join(where, NAME)
        self.inbox: queue.Queue = queue.Queue(BACKLOG)
        self.names: set[str] = set()
        self.kept: dict[tuple[str, int], int] = {}  # (name, rank) -> values seen: the thinning's count
        self.last: dict[tuple[str, int], tuple] = {}  # (name, rank) -> (step, value) last written: a redrawn bar's
        self.rows = 0
        self.first: str | None = None  # the run's first metric: the live dashboard shows it
        self.latest: dict[str, tuple[int, float]] = {}  # node -> (rank, the first metric's latest value) of its first rank
        self.dropped = {"names": 0, "thinned": 0, "rows": 0, "backlog": 0}
        self.broken: str | None = None
        self.file = None
        self.thread = threading.Thread(target=self.keep_reading, name="metrics", daemon=True)
        self.thread.start()

    # --- view protocol (the job loop's thread: hand over, never read) ---------------------------

    def attempt(self, plan) -> None:
        self.hand((plan.attempt, None, None, ()))

    def lines(self, node, lines) -> None:
        texts = [(line.rank, line.text) for line in lines if line.rank is not None and not line.more]
        if texts:
            self.hand((None, node.label, self.now(), texts))

    def bars(self, node, bars, at: float | None = None) -> None:
        texts = [(bar.rank, row) for bar in bars for row in bar.rows[:2]]
        if texts:
            self.hand((None, node.label, at if at is not None else self.now(), texts))

    def now(self) -> float:
        recorded = self.recorded() if self.recorded is not None else None
        return recorded if isinstance(recorded, (int, float)) else self.wall()

    def hand(self, batch) -> None:
        try:
            self.inbox.put_nowait(batch)
        except queue.Full:
            self.dropped["backlog"] += len(batch[3])

    def finished(self, result, exit_code: int | None = None, attempts=()) -> None:
        self.close()

    def __enter__(self) -> MetricsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Idempotent: what was handed over is read, and the file closed."""
        if self.thread.is_alive():
            self.inbox.put(None)
            self.thread.join(30)

    def shown(self) -> tuple[str, dict[str, float]] | None:
        """For the live dashboard: the first metric's name, and its latest value on each node's
        first rank (None: none yet)."""
        if self.first is None:
            return None
        return self.first, {node: value for node, (_, value) in dict(self.latest).items()}

    def said(self) -> str | None:
        """What the bounds left out, in words (None: nothing)."""
        words = {"names": "values of names past the first %d" % NAMES_MOST,
                 "thinned": "values thinned out of long series (past %d a rank)" % SERIES_MOST,
                 "rows": "values past the file's %d rows" % ROWS_MOST,
                 "backlog": "lines not read for metrics (the reader fell behind)"}
        parts = ["%d %s" % (n, words[k]) for k, n in self.dropped.items() if n]
        return "metrics: left out " + "; ".join(parts) if parts else None

    # --- the reader's thread ----------------------------------------------------------------------

    def keep_reading(self) -> None:
        attempt, flushed = self.plan.attempt, time.monotonic()
        while True:
            try:
                batch = self.inbox.get(timeout=FLUSH_EVERY)
            except queue.Empty:  # a quiet while: what came is on disk
                self.flush()
                continue
            if batch is None:
                break
            if batch[0] is not None:
                attempt = batch[0]
                continue
            _, node, at, texts = batch
            for rank, text in texts:
                for value in self.reader.read(text):
                    self.keep(at, attempt, rank, node, value)
            if self.file is not None and time.monotonic() - flushed >= FLUSH_EVERY:
                self.flush()
                flushed = time.monotonic()
        self.flush()
        if self.file is not None:
            self.file.close()

    def keep(self, at: float, attempt: int, rank: int, node: str, value) -> None:
        name = self.plan.mask(value.name)
        if name not in self.names and len(self.names) >= NAMES_MOST:
            self.dropped["names"] += 1
            return
        key = (name, rank)
        if self.last.get(key) == (value.step, value.value):
            return  # a bar redrawn with the same count and value
        self.last[key] = (value.step, value.value)
        seen = self.kept[key] = self.kept.get(key, 0) + 1
        stride = 1 << max(0, (seen - 1) // SERIES_MOST)
        if seen % stride:
            self.dropped["thinned"] += 1
            return
        if self.rows >= ROWS_MOST:
            self.dropped["rows"] += 1
            return
        self.names.add(name)
        self.first = self.first or name
        if name == self.first and rank <= self.latest.get(node, (rank, 0.0))[0]:
            self.latest[node] = (rank, value.value)
        self.write([f"{at:.3f}", attempt, rank, node, "" if value.step is None else f"{value.step:g}", name,
                    repr(value.value)])

    def write(self, row: list) -> None:
        if self.broken is not None:
            return
        try:
            if self.file is None:
                self.file = os.fdopen(no_link_open(self.path, fresh=True), "w", encoding="utf-8", newline="")
                self.csv = csv.writer(self.file)
                self.csv.writerow(COLUMNS)
            self.csv.writerow(row)
            self.rows += 1
        except (OSError, ValueError) as e:
            self.broken = str(e)  # the run logs' own writer says a runs dir that cannot be written

    def flush(self) -> None:
        if self.file is not None and self.broken is None:
            try:
                self.file.flush()
            except OSError as e:
                self.broken = str(e)
