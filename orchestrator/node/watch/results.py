"""A function's launch from Python (orchestrator.launch): each rank's return value, as the
function runner (plan/call.py) left it beside the attempt's hooks, read back for the controller."""

import os
import re

from ..local.state import open_regular
from ..protocol import wire

RESULT_FILE = re.compile(r"result\.(\d{1,7})")  # what it leaves for each global rank, beside itself
RESULT_LIMIT = 8 << 20  # the runner's own limit (a bigger value fails the rank, saying so)


def call_results(hooks, nproc):
    """The Result frames of a function's launch: each rank's pickled return value (at most one per
    local rank), read bounded from a regular file only (never through a link, never blocking). A
    rank that left none failed, and its failure says why."""
    try:
        names = [e.name for e in os.scandir(hooks)]
    except OSError:
        return []
    found = sorted((int(m.group(1)), m.group(0)) for m in map(RESULT_FILE.fullmatch, names) if m)[:nproc]
    frames = []
    for rank, name in found:
        fd = open_regular(os.path.join(hooks, name))
        if fd is None:
            frames.append(wire.Result(rank=rank, problem="its result is not a regular file", data=b""))
            continue
        with os.fdopen(fd, "rb") as f:
            data = f.read(RESULT_LIMIT + 1)
        problem = "its result is over %d MiB" % (RESULT_LIMIT >> 20) if len(data) > RESULT_LIMIT else None
        frames.append(wire.Result(rank=rank, problem=problem, data=b"" if problem else data))
    return frames
