"""The agent's entry: the spec frame the controller sends first picks the mode, from one table."""

import os
import sys

from . import wire
from .detached import DetachedRun
from .fetch import fetch
from .oneshot import detect, sweep
from .relay import Writer
from .replay import follow, list_jobs
from .run import Runner
from .sync import receive


def run_mode(spec, writer):
    return (DetachedRun if spec.detach else Runner)(spec, writer).run()


MODES = {  # spec frame -> the mode that answers it: f(spec, writer) -> exit status
    wire.RunSpec: run_mode,
    wire.DetectSpec: detect,
    wire.SweepSpec: sweep,
    wire.SyncSpec: lambda spec, writer: receive(spec, writer, sys.stdin.buffer),
    wire.FollowSpec: follow,
    wire.ListSpec: lambda spec, writer: list_jobs(writer),
    wire.FetchSpec: fetch,
}


def main():
    writer = Writer(sys.stdout.buffer)
    try:
        spec = wire.read_frame(sys.stdin.buffer)
        if spec is None:  # the controller went away before saying what to do (a failed sync scan)
            os._exit(0)
        mode = MODES.get(type(spec))
        if mode is None:
            raise wire.ProtocolError("expected a spec frame first, got %s" % type(spec).__name__)
    except wire.ProtocolError as e:
        writer.send(wire.Failed(what="protocol error from the controller: %s" % e,
                                fix="use the same ddp-up version on both ends"))
        writer.drain(5)
        os._exit(3)
    code = mode(spec, writer)
    sys.stdout.flush()
    os._exit(code)  # daemon threads may be blocked on a dead pipe; do not wait for them
