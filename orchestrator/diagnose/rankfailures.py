"""Which of a node's ranks failed by themselves, when, and with what exception. Pure.

Two sources, joined by rank: torchrun's failure report (which ranks failed, their exit codes, the
time to the second) and what the node's agent read of each failed rank's error file or traceback
(node/watch/failures.py: the exception, the time to the nanosecond). The agent already left out what
failed only because of a stop ddp-up asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..node.protocol import policy
from ..node.watch.report import FailureReportParser
from .outcome import Failure

SKEW_TRUSTED = 0.5  # a node clock's measured offset past this is corrected; below it, the measure is mostly latency
REPORT_WINDOW = 1.0  # torchrun's report says the second: the failure may be up to this much later


@dataclass(frozen=True)
class RankError:
    """One rank's exception as its node read it (the node's own clock)."""

    rank: int  # global
    at: float
    exception: str
    trace: tuple[str, ...]
    error_file: str | None  # torchelastic's error file, as the rank wrote it (kept in the run's logs)


def rank_errors(failures: list | None, first_rank: int) -> list[RankError]:
    """The node's Exited.failures as values; an entry of the wrong shape is left out (it came
    through the agent, but its text is the job's)."""
    found = []
    for entry in failures or ():
        try:
            local, at, exception = entry["rank"], float(entry["at"]), str(entry["exception"])
            trace, error_file = tuple(str(line) for line in entry["trace"]), entry.get("error_file")
        except (KeyError, TypeError, ValueError, AttributeError):
            continue
        if isinstance(local, int) and local >= 0 and (error_file is None or isinstance(error_file, str)):
            found.append(RankError(first_rank + local, at, exception, trace, error_file))
    return found


def rank_ends(ends: dict | None, first_rank: int) -> dict[int, float]:
    """The node's Exited.ends ({local rank: when it ended}) by global rank; odd entries left out."""
    found = {}
    for local, at in (ends or {}).items():
        if isinstance(local, str) and local.isascii() and local.isdigit() and isinstance(at, (int, float)) \
                and not isinstance(at, bool):
            found[first_rank + int(local)] = float(at)
    return found


def node_clock(at: float, skew: float | None) -> float:
    """A node's wall time on the controller's clock, where their offset is known to matter."""
    return at - skew if skew is not None and abs(skew) > SKEW_TRUSTED else at


def uncaught_code(error: RankError | None) -> int | None:
    """The exit status Python gives a rank whose exception went uncaught (1), where torchrun's
    report has none (a launcher stopped before it wrote one): every node then words the same kind of
    failure alike. None where Python gives another: KeyboardInterrupt ends by SIGINT."""
    if error is None or error.exception.split(":", 1)[0].rsplit(".", 1)[-1] == "KeyboardInterrupt":
        return None
    return 1


def own_failures(node: int, label: str, report: FailureReportParser, errors: list[RankError],
                 ends: dict[int, float], skew: float | None) -> list[Failure]:
    """Every rank torchrun's report names (or, without a report, every rank that left an
    exception), with its exception and its own time: when it wrote its exception, else when the
    node saw it end, else the report's second. One with no time gets it when it is recorded."""
    by_rank = {e.rank: e for e in errors}
    failed = []
    for rank in sorted(report.failed) if report.failed else sorted(by_rank):
        entry, error = report.failed.get(rank), by_rank.get(rank)
        code = entry.exit_code if entry is not None else None
        shown = code if code is not None else uncaught_code(error)
        what = f"rank {rank} {policy.exit_words(shown)}" if shown is not None else f"rank {rank} raised"
        if error is not None or rank in ends:
            at, window = node_clock(error.at if error is not None else ends[rank], skew), 0.0
        else:
            known = entry is not None and entry.time is not None
            at, window = (node_clock(entry.time, skew) if known else None), (REPORT_WINDOW if known else 0.0)
        failed.append(Failure(node, label, rank, code, what, at, error.exception if error else None,
                              error.trace if error else (), window))
    return sorted(failed, key=lambda f: float("inf") if f.at is None else f.at)
