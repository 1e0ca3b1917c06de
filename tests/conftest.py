import os
import sys
from pathlib import Path

import pytest

# The package is importable from a checkout without installing it (tests run it by source).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.pop("DDP_UP_JOB", None)


def pytest_sessionstart(session):
    """The package compiled once, before any test: every ddp-up a test starts is a new Python, and
    where PYTHONDONTWRITEBYTECODE is set (these machines set it) each would compile every module of
    it again from source (0.1 s of CPU, hundreds of times in a run). Written into the checkout's own
    __pycache__ directories, which git ignores."""
    if not hasattr(session.config, "workerinput"):  # xdist's controller, or a run without workers: once
        import compileall

        compileall.compile_dir(str(Path(__file__).resolve().parents[1] / "orchestrator"), quiet=1)


def pytest_collection_modifyitems(items):
    """The long tests first (marked `long`), in their order: the workers then end on short ones,
    not one worker on a minute of waiting while the other cores idle. pytest-xdist hands out its
    groups first, then single tests in this order."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


@pytest.fixture(autouse=True)
def test_scope(tmp_path):
    """Leak checks count what this test started, nothing else (tests/harness/procs.TestScope)."""
    from tests.harness import procs

    procs.SCOPE = procs.TestScope(tmp_path)
    yield
    procs.SCOPE = None
