"""The teardown rule, by the end marker each rank's hook leaves as its script ends (rankhook's end watch):
a rank that ended its script with status 0, then died by a signal in the interpreter's teardown
(torch's C++ threads at exit), ended the job's work (launch.outcome, by died_in_teardown); and a
node whose ranks have all ended their scripts is finishing, not silent, while their teardown and
their launcher's end run (scripts_ended here, failures.RankEnds under a launcher).
"""

import os

from ..local.state import per_attempt

SCRIPTS_EVERY = 0.2  # seconds between looks for the ranks' end markers, while some run


TEARDOWN = "every rank ended its script, then the launcher %s: a death in Python's teardown after the " \
    "script's end (torch's threads), not counted as a failure"


def ended_scripts(state_dir, attempt):
    """The ranks whose scripts ended cleanly in ``attempt``: the ended.RANK files rankhook's end watch left."""
    try:
        names = os.listdir(hooks_dir(state_dir, attempt))
    except OSError:
        return set()
    return {int(name[6:]) for name in names if name.startswith("ended.") and name[6:].isdigit()}


def hooks_dir(state_dir, attempt):
    return os.path.join(state_dir, per_attempt("hooks", attempt))  # a detached restart: same state dir


def scripts_ended(over, markers, process_ends, first, count, tell):
    """`launcher: none`: ``tell()`` once every rank of this node (``count`` of them from global rank
    ``first``) has ended its script (``markers()``: the global ranks ended_scripts gives) or its
    process (``process_ends()``: local ranks), until ``over`` is set. Its teardown's silence is then
    finishing, no hang (under a launcher, failures.RankEnds watches its children so)."""
    while not over.wait(SCRIPTS_EVERY):
        ended = {rank - first for rank in markers()} | set(process_ends())
        if count and len(ended & set(range(count))) >= count:
            tell()
            return


def died_in_teardown(report):
    """Whether the launcher's failure report (report.FailureReportParser) names only ranks killed by
    a signal: a death in the interpreter's teardown. A rank that exited with a code of its own (a
    bare ``raise SystemExit(3)``, which its end watch cannot see) failed, whatever its marker says;
    so does a launcher that named no rank."""
    failed = list(report.failed.values()) or ([report.root] if report.root is not None else [])
    return bool(failed) and all(f.exit_code is not None and f.exit_code < 0 for f in failed)
