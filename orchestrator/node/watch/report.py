"""torchrun's failure report, read from the launcher's own lines: the ranks it names, with their
exit codes. The controller reads it (diagnose/) and so does a detached job's agent, for the rank's
own exit code where torchrun's is 1 for any rank: one reader for both ends. Stdlib only, pure."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime

_FIELD = re.compile(r"^\s*(time|host|rank|exitcode)\s*:\s*(.*)$")
_ENTRY = re.compile(r"^\s*\[\d+\]:\s*$")
# torchrun, when a worker outlived its shutdown timeout (set to stop_grace) and got SIGKILL
_FORCED = re.compile(r"Unable to shutdown process \d+ via \S+, forcefully exiting via")
# the last line of a Python traceback: the exception's (dotted) name, at the line's start
_RAISED = re.compile(r"[A-Za-z_][\w.]{0,200}(Error|Exception|Interrupt|Exit|Failure|Timeout)\b(: .*)?$")
EXCEPTION_MOST = 500  # characters of the launcher's exception kept


@dataclass(frozen=True)
class WorkerFailure:
    """One entry of torchrun's failure report (its root cause, or one of its other failures)."""

    rank: int | None
    exit_code: int | None
    host: str | None
    time: float | None  # wall clock of the failure on the node, to the second, if reported


class FailureReportParser:
    """Fed the launcher's own (unranked) lines; remembers the report's root cause and every
    failed rank it lists (``failed``: {global rank: its entry}), and counts the workers it killed
    when their stop took longer than its shutdown timeout, and the launcher's own exception (the
    last line of a traceback of its own: torchrun failing to bind its store, to rendezvous)."""

    def __init__(self) -> None:
        self._in_traceback = False
        self.exception: str | None = None
        self._in_report = False
        self._in_root = False
        self._fields: dict[str, str] = {}
        self.root: WorkerFailure | None = None
        self.failed: dict[int, WorkerFailure] = {}
        self.forced = 0  # workers torchrun killed at the end of its shutdown timeout (stop_grace)

    def feed(self, text: str) -> None:
        if _FORCED.search(text):
            self.forced += 1
        if text.startswith("Traceback (most recent call last):"):
            self._in_traceback = True
        elif self._in_traceback and not text.startswith((" ", "\t")) and _RAISED.match(text):
            self.exception, self._in_traceback = text[:EXCEPTION_MOST], False
        if text.startswith("Failures:") or "Root Cause (first observed failure)" in text:
            self._in_report, self._in_root, self._fields = True, "Root Cause" in text, {}
            return
        if not self._in_report:
            return
        m = _FIELD.match(text)
        if m:
            self._fields[m.group(1)] = m.group(2).strip()
            if m.group(1) == "exitcode":
                self.entry(_failure(self._fields))
        elif _ENTRY.match(text):
            self._fields = {}
        elif text.startswith("====="):
            self._in_report = self._in_root = False

    def entry(self, failure: WorkerFailure) -> None:
        if failure.rank is not None:
            self.failed[failure.rank] = failure
        if self._in_root:
            self.root = failure


def _failure(fields: dict[str, str]) -> WorkerFailure:
    rank = re.match(r"(-?\d+)", fields.get("rank", ""))
    code = re.match(r"(-?\d+)", fields.get("exitcode", ""))
    return WorkerFailure(
        rank=int(rank.group(1)) if rank else None,
        exit_code=int(code.group(1)) if code else None,
        host=fields.get("host"),
        time=_timestamp(fields.get("time", "")),
    )


def _timestamp(text: str) -> float | None:
    try:
        return datetime.fromisoformat(text.replace("_", "T", 1)).timestamp()
    except ValueError:
        return None


class ReportReader:
    """The launcher's own output as it is relayed (bytes, in pieces of any size) into a
    FailureReportParser, line by line: linear in what it is fed, and bounded (a line longer than
    LINE_MOST is none of the report's, and is passed over)."""

    LINE_MOST = 4096

    def __init__(self):
        self.parser = FailureReportParser()
        self.partial = b""

    def feed(self, data):
        *lines, rest = (self.partial + data).split(b"\n")
        self.partial = rest if len(rest) <= self.LINE_MOST else b""
        for line in lines:
            if len(line) <= self.LINE_MOST:
                self.parser.feed(line.decode("utf-8", "replace").rstrip("\r"))

    def rank_code(self):
        """The exit code of the rank torchrun's report names as the root cause, or None."""
        root = self.parser.root
        return root.exit_code if root is not None else None
