"""The agent's entry, once the loader (boot.py) built the package: its name in ps, then the spec frame
the controller sends first picks the mode, from one table."""

import importlib
import os
import sys

from .protocol import wire
from .userpython.proctitle import rename
from .watch.relay import Writer

AGENT_FAILED = 70  # the agent's own failure (an uncaught exception): remote/channel.py names it

# Spec frame -> "module.function" of the mode that answers it: function(spec, writer) -> exit
# status. By name, imported when asked: an agent is shipped only the modules its mode needs
# (protocol.modules_for reads this table), so main imports none of them itself.
MODES = {
    wire.RunSpec: "supervise.detached.run_mode",
    wire.DetectSpec: "oneshot.detect",
    wire.SweepSpec: "oneshot.sweep",
    wire.SyncSpec: "files.sync.receive",
    wire.FollowSpec: "supervise.replay.follow",
    wire.ListSpec: "supervise.replay.list_jobs",
    wire.FetchSpec: "files.fetch.fetch",
    wire.KeepSpec: "attempt.keep.keep",
}


def answering(spec):
    """The function that answers ``spec``; ProtocolError if none here does."""
    where = MODES.get(type(spec))
    if where is None:
        raise wire.ProtocolError("expected a spec frame first, got %s" % type(spec).__name__)
    module, _, function = where.rpartition(".")
    try:
        return getattr(importlib.import_module("." + module, __package__), function)
    except ImportError:  # the controller shipped another mode's modules
        raise wire.ProtocolError("this agent was not sent the code for %s" % type(spec).__name__) from None


def main():
    rename(sys.argv[1:], "ddp-up-agent")  # in ps, its name, job and node (remote/protocol.title), not its loader
    writer = Writer(sys.stdout.buffer)
    try:
        spec = wire.read_frame(sys.stdin.buffer)
        if spec is None:  # the controller went away before saying what to do (a failed sync scan)
            os._exit(0)
        mode = answering(spec)
    except wire.ProtocolError as e:
        writer.send(wire.Failed(what="protocol error from the controller: %s" % e,
                                fix="use the same ddp-up version on both ends"))
        writer.drain(5)
        os._exit(3)
    try:
        code = mode(spec, writer)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # a bug of the agent's: its traceback, to stderr, which the controller names;
        import traceback  # never Python's teardown, where daemon threads that hold stdout abort it

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(AGENT_FAILED)
    sys.stdout.flush()
    os._exit(code)  # daemon threads may be blocked on a dead pipe; do not wait for them
