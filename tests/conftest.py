import os
import sys
from pathlib import Path

import pytest

# The package is importable from a checkout without installing it (tests run it by source).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.pop("DDP_UP_JOB", None)


@pytest.fixture(autouse=True)
def test_scope(tmp_path):
    """Leak checks count what this test started, nothing else (tests/harness/procs.TestScope)."""
    from tests.harness import procs

    procs.SCOPE = procs.TestScope(tmp_path)
    yield
    procs.SCOPE = None
