"""A function's launch (the Python API): the function, shipped by value, and what the ranks run.

cloudpickle pickles the function with its closure, and a function defined in a notebook cell or a
``__main__`` script by value, so the nodes need only cloudpickle itself (and whatever modules the
function imports by name). The payload travels in the agent's RunSpec as a hook file, in the
node's private state directory, never through a shared path. Each rank's return value comes back
the same way, over the agent's channel (node/launch.call_results), bounded in size.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError
from ..node.attempt.checks import CALL_HOOK
from ..node.watch.results import RESULT_LIMIT
from .rank_call import PAYLOAD

MODULE = CALL_HOOK[:-len(".py")]  # the hook the ranks run: -m ddp_up_call
PAYLOAD_LIMIT = 16 << 20  # bytes of the pickled function and arguments: big data goes by path
BACKENDS = ("auto", "gloo", "nccl", "mpi")


@dataclass(frozen=True)
class Call:
    """The function to run on every rank, pickled with its arguments and the backend."""

    name: str  # how messages name it
    payload: bytes

    @classmethod
    def of(cls, fn, args=(), kwargs=None, backend: str | None = "auto") -> "Call":
        """UsageError (nothing started) for a function that cannot be pickled, or one too big."""
        if backend is not None and backend not in BACKENDS:
            raise UsageError(f"backend={backend!r}: one of {', '.join(BACKENDS)}, or None (no process group)")
        name = getattr(fn, "__name__", None) or type(fn).__name__
        import cloudpickle  # a dependency, imported here: a command line's start does not pay for it

        try:
            payload = cloudpickle.dumps((fn, tuple(args), dict(kwargs or {}), backend, RESULT_LIMIT))
        except Exception as e:  # pickling runs the objects' own code: any error is the function's
            raise UsageError(f"{name} cannot be shipped to the nodes: {type(e).__name__}: {e}; pass what it "
                             "needs as arguments that pickle (not open files, locks or connections), or open "
                             "those inside the function") from None
        if len(payload) > PAYLOAD_LIMIT:
            raise UsageError(f"{name} and its arguments are {len(payload) >> 20} MiB pickled; at most "
                             f"{PAYLOAD_LIMIT >> 20} MiB go with the job: put big data in a file on the nodes "
                             "and pass its path")
        return cls(name, payload)

    def hooks(self) -> dict[str, str]:
        """The files the ranks run: the runner and the payload (hook files are text)."""
        runner = (Path(__file__).parent / "rank_call.py").read_text(encoding="utf-8")
        return {CALL_HOOK: runner, PAYLOAD: base64.b64encode(self.payload).decode("ascii")}
