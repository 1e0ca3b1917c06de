"""Parsing what torchrun prints: rank prefixes on worker lines, and its failure report. Pure."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime

from .plan import RANK_MARK

_RANK_LINE = re.compile(re.escape(RANK_MARK) + r"(\d+)" + re.escape(RANK_MARK))
_FIELD = re.compile(r"^\s*(time|host|rank|exitcode)\s*:\s*(.*)$")


def split_rank(text: str) -> tuple[int | None, str]:
    """``'\\x1d5\\x1dloss 0.1'`` -> ``(5, 'loss 0.1')``; launcher lines have no rank."""
    if text.startswith(RANK_MARK):
        m = _RANK_LINE.match(text)
        if m:
            return int(m.group(1)), text[m.end():]
    return None, text


@dataclass(frozen=True)
class WorkerFailure:
    """torchrun's 'Root Cause (first observed failure)' entry."""

    rank: int | None
    exit_code: int | None
    host: str | None
    time: float | None  # wall clock of the failure on the node, if reported


class FailureReportParser:
    """Fed the launcher's own (unranked) lines; remembers the root-cause block."""

    def __init__(self) -> None:
        self._in_root = False
        self._fields: dict[str, str] = {}
        self.root: WorkerFailure | None = None

    def feed(self, text: str) -> None:
        if "Root Cause (first observed failure)" in text:
            self._in_root, self._fields = True, {}
            return
        if not self._in_root:
            return
        m = _FIELD.match(text)
        if m:
            self._fields[m.group(1)] = m.group(2).strip()
            if m.group(1) == "exitcode":
                self.root = _failure(self._fields)
        elif text.startswith("====="):
            self._in_root = False


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
