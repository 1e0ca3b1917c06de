"""Every line of every rank on the controller: ``runs/<job-id>/`` with one file per node, one per
global rank, and ``summary.json``. Not filtered by --ranks or --collapse: the files keep all.

A rank log holds exactly the bytes the rank printed (text that was not UTF-8 travels as
surrogates and is written back as the same bytes; a line cut into pieces on the node is joined
again here, and no other line lands inside it: see WholeLines). Logging is never a reason to stop training: a runs directory that cannot be created
or written (a full disk, no permission) is reported once, the job goes on, and ``summary.json``
is still attempted at the end with the exit status ddp-up returns.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from datetime import datetime, timezone
from typing import IO, Callable

from ..config.masking import mask_secrets, mask_values
from ..diagnose.gpuhealth import describe, health_of
from ..diagnose.progress import Bar, Snapshots
from ..job.events import LogLine
from ..ownfiles import no_link_open, own_dir, safe_name
from ..plan.launch import LaunchPlan, NodePlan

SEPARATOR = {"out": "|", "err": "!", "node": "~"}
_END = ("\n", "")  # by LogLine.more


def _iso(wall: float | None) -> str | None:
    return None if wall is None else datetime.fromtimestamp(wall, timezone.utc).isoformat()


VERSIONS = ("hostname", "python", "torch", "cuda", "nccl")  # a node's, from its preflight, in summary.json
HOLD_MOST = 8 << 20  # characters of other lines held while one line arrives in pieces; past it, that line is cut


def gpus_said(info: dict) -> dict:
    """{"gpus": what nvidia-smi said of each of the job's GPUs at the preflight}, for summary.json
    (the report shows it); {} where it said nothing."""
    health = health_of(info)
    return {"gpus": [{"index": g.get("index"), "name": g.get("name"), "said": describe(g)} for g in health]} if health else {}


class WholeLines:
    """One log file's writer that never puts a line inside another's unfinished one. A line longer
    than the node sends at once arrives in pieces (LogLine.more); while one source's line (a
    rank's stream) is open, every other source's lines wait, and follow it once it ends. Past
    HOLD_MOST characters waiting, the open line is ended where it is (it goes on as a new line)."""

    def __init__(self, f: IO[str], prefix: Callable[[LogLine], str]):
        self.f, self.prefix = f, prefix
        self.open: tuple | None = None  # (rank, stream) whose line is unfinished
        self.waiting: list[LogLine] = []
        self.held = 0

    def write(self, lines: list[LogLine]) -> None:
        if self.open is None and not any(line.more for line in lines):  # the common case: whole lines only
            self.f.writelines(self.prefix(line) + line.text + "\n" for line in lines)
            return
        out: list[str] = []
        pending = deque(lines)
        while pending:
            line = pending.popleft()
            key = (line.rank, line.stream)
            if self.open is not None and key != self.open:
                self.waiting.append(line)
                self.held += len(line.text)
                if self.held <= HOLD_MOST:
                    continue
                out.append("\n")
                self.open = None
            else:
                out.append(("" if key == self.open else self.prefix(line)) + line.text + _END[line.more])
                self.open = key if line.more else None
            if self.open is None and self.waiting:
                pending.extendleft(reversed(self.waiting))
                self.waiting, self.held = [], 0
        self.f.writelines(out)

    def close(self) -> None:
        """What still waits follows the unfinished line, on a line of its own; an unfinished line
        with nothing after it stays as the rank left it (the unterminated end of its output)."""
        if self.waiting:
            self.f.write("\n" if self.open is not None else "")
            self.f.writelines(self.prefix(line) + line.text + _END[line.more] for line in self.waiting)
        self.f.close()


def node_prefix(line: LogLine) -> str:
    return f"{'r' + str(line.rank) if line.rank is not None else '-'} {SEPARATOR[line.stream]} "


def no_prefix(line: LogLine) -> str:
    return ""


class RunLogs:
    def __init__(self, plan: LaunchPlan, root: str, wall=time.time, warn: Callable[[str], None] | None = None,
                 fresh: bool = False):
        self.plan = plan
        self.mode = "w" if fresh else "a"  # fresh: the lines are all coming again (an attach replays them)
        self.dir = os.path.join(root, plan.job_id)
        self.wall = wall
        self.warn = warn or (lambda text: None)
        self.started = wall()
        self.node_started: dict[int, float] = {}
        self.node_ended: dict[int, float] = {}
        self.node_versions: dict[int, dict] = {}  # what each node's agent reported at its preflight
        self.node_files: dict[int, WholeLines] = {}
        self.rank_files: dict[int, WholeLines] = {}
        self.broken: str | None = None  # why line logging stopped (reported once)
        self.bar_written = Snapshots()  # by (rank, stream)
        self.sub = ""  # a restart's files go to attempt<N>/: each attempt's lines apart, none lost
        self.taking = None  # the run's record while git's calls go on (record)
        try:
            own_dir(self.dir, private=True)
        except OSError as e:
            self._failed(e)

    def __enter__(self) -> RunLogs:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Idempotent: the files of a job that ended before ``finished`` are closed too (and its record written)."""
        self.record(self.taking, block=True)
        for f in (*self.node_files.values(), *self.rank_files.values()):
            try:
                f.close()
            except OSError as e:  # the last buffered write failed
                self._failed(e)
        self.node_files.clear()
        self.rank_files.clear()

    def _failed(self, e: OSError) -> None:
        if self.broken is None:
            self.broken = e.strerror or str(e)
            self.warn(f"cannot write the run logs in {self.dir} ({self.broken}); the job goes on, "
                      f"and its output still reaches this terminal")

    def _open(self, name: str) -> IO[str]:
        where = own_dir(os.path.join(self.dir, self.sub), private=True)
        # surrogateescape: bytes that were not UTF-8 are written back exactly as the rank printed them
        return os.fdopen(no_link_open(os.path.join(where, name), fresh=self.mode == "w"), self.mode, encoding="utf-8",
                         errors="surrogateescape")

    def record(self, taking, block: bool = False) -> None:
        """What ran (run/record.RecordTaking), beside the logs once git has answered: at this call,
        at a tick of the job's loop, or at the latest (``block``) as the logs close. None: a dry run."""
        record = taking and taking.taken(block)
        self.taking = taking if record is None and not block else None  # None: written, or git's budget has passed
        try:
            if record is not None and self.broken is None:
                record.write(self.dir, self.plan.secrets)
        except OSError as e:
            self._failed(e)

    def attempt(self, plan: LaunchPlan) -> None:
        """A restart: attempt N's node and rank files in attempt<N>/, beside attempt 0's."""
        self.close()
        self.plan = plan
        self.sub = f"attempt{plan.attempt}"
        self.node_started.clear()
        self.node_ended.clear()

    def _node_file(self, node: NodePlan) -> WholeLines:
        f = self.node_files.get(node.index)
        if f is None:
            f = self.node_files[node.index] = WholeLines(self._open(f"node{node.index}-{safe_name(node.label)}.log"),
                                                         node_prefix)
        return f

    def _rank_file(self, rank: int) -> WholeLines:
        f = self.rank_files.get(rank)
        if f is None:
            f = self.rank_files[rank] = WholeLines(self._open(f"rank{rank}.log"), no_prefix)
        return f

    # --- view protocol ---

    def lines(self, node: NodePlan, lines: list[LogLine], snapshot: bool = False) -> None:
        if self.broken is not None:
            return
        if not snapshot:  # a row a bar's snapshot wrote already is not written again (Snapshots)
            lines = [line for line in lines if line.rank is None or line.more
                     or not self.bar_written.written((line.stream,), line.rank, line.text)]
        try:
            self._write(node, lines)
        except OSError as e:
            self._failed(e)

    def _write(self, node: NodePlan, lines: list[LogLine]) -> None:
        self._node_file(node).write(lines)
        by_rank: dict[int, list[LogLine]] = {}
        for line in lines:
            if line.rank is not None:
                by_rank.setdefault(line.rank, []).append(line)
        for rank, mine in by_rank.items():  # one write per rank and batch, not per line
            self._rank_file(rank).write(mine)

    def bars(self, node: NodePlan, bars: list[Bar], at: float | None = None) -> None:
        """Each rank's bar as lines (a row a line), at most every BAR_EVERY seconds (of ``at``,
        when the node recorded them, for a replay: wall clocks both): a long bar leaves a trace of
        its pace; its final state is the line the rank ends it with."""
        now = self.wall() if at is None else at
        due = [bar for bar in bars if bar.rows and self.bar_written.due((bar.rank, bar.stream), now)]
        for bar in due:
            self.bar_written.wrote((bar.stream,), bar.rank, bar.rows)
        if due:
            self.lines(node, [LogLine(bar.stream, bar.rank, row) for bar in due for row in bar.rows], snapshot=True)

    def event(self, kind: str, text: str, **fields) -> None:
        pass

    def kept_lines(self, node: NodePlan, lines: list[LogLine]) -> None:
        """Lines for the log files only, not the terminal (the launcher's report of a stop)."""
        self.lines(node, lines)

    def node_state(self, status) -> None:
        if status.state == "ready":
            self.node_versions[status.plan.index] = {k: status.info.get(k) for k in VERSIONS} | gpus_said(status.info)
        if status.state == "starting":
            self.node_started.setdefault(status.plan.index, self.wall())
        if status.terminal:
            self.node_ended.setdefault(status.plan.index, self.wall())
            self.error_files(status.rank_errors)

    def error_files(self, errors) -> None:
        """Each failed rank's torchelastic error file, as ``rank<N>.error.json`` beside its log:
        the copy on the node is in ddp-up's state directory, which goes at the job's end."""
        for error in errors:
            if error.error_file is None or self.broken is not None:
                continue
            try:
                with self._open(f"rank{error.rank}.error.json") as f:
                    f.write(mask_secrets(error.error_file, self.plan.secrets))
            except OSError as e:
                self._failed(e)

    def notice(self, text: str) -> None:
        pass

    def tick(self, snapshot) -> None:
        self.record(self.taking)

    def finished(self, result, exit_code: int | None = None, attempts=()) -> None:
        """Close the line files and write summary.json with ``exit_code`` (the status ddp-up
        returns; the result's own unless ddp-up ends otherwise, e.g. a setup error)."""
        self.close()
        self.collective_files(result.collectives)
        summary = summary_of(self, result, result.exit_code if exit_code is None else exit_code)
        if attempts:
            summary["attempts"] = mask_values([a.as_dict(_iso) for a in attempts], self.plan.secrets)
        try:
            tmp = os.path.join(own_dir(self.dir, private=True), ".summary.json.tmp")
            with os.fdopen(no_link_open(tmp, fresh=True), "w", encoding="utf-8") as f:
                json.dump(summary, f, indent=2)
                f.write("\n")
            os.replace(tmp, os.path.join(self.dir, "summary.json"))
        except OSError as e:
            self._failed(e)  # reported once: a runs dir that failed before fails here too

    def collective_files(self, diagnosis) -> None:
        """Each rank's last collectives, as ``rank<N>.collectives.json`` beside its log, with the
        paragraph read from them all (flight.py)."""
        for rank, entries in sorted(diagnosis.records.items()) if diagnosis is not None and self.broken is None else ():
            try:
                with self._open(f"rank{rank}.collectives.json") as f:
                    json.dump({"rank": rank, "diagnosis": diagnosis.text, "entries": [e._asdict() for e in entries]},
                              f, indent=1)
            except OSError as e:
                self._failed(e)


def summary_of(logs: RunLogs, result, exit_code: int) -> dict:
    """summary.json's fields: the run's end and each node's, masked; ``exit_code`` is ddp-up's."""
    root = result.root_cause
    late = {f.node: f.as_dict() for f in result.lateness}
    return mask_values({
        "job_id": logs.plan.job_id,
        "master": result.master_text,
        "world_size": logs.plan.world_size,
        "script": logs.plan.script,
        "args": list(logs.plan.script_args),
        "started": _iso(result.started or logs.started),
        "ended": _iso(result.ended if result.started is not None else logs.wall()),
        "exit_code": exit_code,
        "interrupted_by": result.interrupted,
        "root_cause": None if root is None else {
            "node": root.node, "host": root.label, "rank": root.rank, "exit_code": root.exit_code,
            "what": root.what, "kind": root.kind, "at": _iso(root.at), "exception": root.exception,
            "traceback": list(root.trace)},
        "nodes": [{
            "node": s.plan.index, "host": s.plan.label, "ranks": [s.plan.ranks.start, s.plan.ranks.stop - 1],
            "state": s.state, "exit_code": s.exit_code, "signal": s.signal, "reason": s.reason,
            "lines": s.lines, "stop_seconds": s.stop_seconds, "started": _iso(logs.node_started.get(s.plan.index)),
            "ended": _iso(logs.node_ended.get(s.plan.index)),
            **logs.node_versions.get(s.plan.index, {}),
            **({"collectives": late[s.plan.index]} if s.plan.index in late else {})} for s in result.nodes],
        "collectives": None if result.collectives is None else result.collectives.text,
    }, logs.plan.secrets)
