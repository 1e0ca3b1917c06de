import os
import sys
from collections import Counter
from pathlib import Path

import pytest

# The package is importable from a checkout without installing it (tests run it by source).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.pop("DDP_UP_JOB", None)
# pytest keeps its assertion-rewritten test modules as bytecode only where Python may write it;
# these machines set PYTHONDONTWRITEBYTECODE, so each worker of each run rewrote all of them again
# (4-5 s of CPU a process). Git ignores __pycache__.
sys.dont_write_bytecode = False


CHECKOUT_RUNS = Path(__file__).resolve().parents[1] / "runs"  # a user's own runs, never the suite's


def runs_in_checkout() -> set[str]:
    return set(os.listdir(CHECKOUT_RUNS)) if CHECKOUT_RUNS.is_dir() else set()


def pytest_sessionstart(session):
    """The package compiled once, before any test: every ddp-up a test starts is a new Python, and
    where PYTHONDONTWRITEBYTECODE is set (these machines set it) each would compile every module of
    it again from source (0.1 s of CPU, hundreds of times in a run). Written into the checkout's own
    __pycache__ directories, which git ignores."""
    if not hasattr(session.config, "workerinput"):  # xdist's controller, or a run without workers: once
        import compileall

        compileall.compile_dir(str(Path(__file__).resolve().parents[1] / "orchestrator"), quiet=1)
        session.config.stash[RUNS_BEFORE] = runs_in_checkout()


RUNS_BEFORE = pytest.StashKey[set]()


def pytest_sessionfinish(session, exitstatus):
    """A test that writes a run folder into the checkout's runs/ (a ddp-up without --runs-dir, run
    from the checkout) fails the run: the suite's runs go under its own temporary directories."""
    before = session.config.stash.get(RUNS_BEFORE, None)
    left = sorted(runs_in_checkout() - before) if before is not None else []
    if left:
        sys.stderr.write(f"\nthe suite left run folders in {CHECKOUT_RUNS}: {', '.join(left)}\n")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


TAIL = 0.85  # the integration tests spread over the run's first 85%: the last of it is unit tests,
# short and all CPU, which the workers share evenly as they finish (not one worker on a run's waits)


def pytest_collection_modifyitems(items):
    """The long tests first (marked `long`), in their order: the workers then end on short ones,
    not one worker on a minute of waiting while the other cores idle. The rest with every file's
    tests spread evenly over the run (each at its place within its file, as a fraction): the
    workers run different files' tests side by side, not consecutive tests of one file. A file's tests are
    alike: the detached fault tests, all waiting on cut links, left both cores idle for two minutes
    when they ran together, while a file of unit tests can fill those waits. pytest-xdist hands out
    its groups first, then single tests in this order; a group's tests (one Slurm cluster, the
    container runtimes: set up once a module) stay together, at their first test's place."""
    sizes, seen = Counter(item.fspath for item in items), Counter()
    place, groups = {}, {}
    for item in items:
        seen[item.fspath] += 1
        group = item.get_closest_marker("xdist_group")
        at = (seen[item.fspath] - 0.5) / sizes[item.fspath] * (TAIL if "integration" in str(item.fspath) else 1.0)
        place[item.nodeid] = groups.setdefault(group.args[0], at) if group else at
    items.sort(key=lambda item: (item.get_closest_marker("long") is None, place[item.nodeid]))


@pytest.fixture(autouse=True)
def test_scope(tmp_path):
    """Leak checks count what this test started, nothing else (tests/harness/procs.TestScope)."""
    from tests.harness import procs

    procs.SCOPE = procs.TestScope(tmp_path)
    yield
    procs.SCOPE = None
