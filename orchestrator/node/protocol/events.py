"""The node agent's own events, named once: what its loop acts on, whoever raised them.

The controller's frames (``from_controller``), the supervisor's (``from_supervisor``), a signal,
the launcher's exit and a silent peer each become one of these on the agent's queue; the run's
loop (run.Runner.next_event) takes them in one place. Each is a value with the frames' own
machinery (wire.Frame: named fields, defaults, immutable, equal by value), in no direction: an
event never travels.
"""

from __future__ import annotations

from . import wire


@wire.value()
class Go(wire.Frame):
    """The controller's Go: start the job (``frame``: the wire.Go)."""
    frame: wire.Frame


@wire.value()
class Probe(wire.Frame):
    """The controller asks whether this node reaches the master (``frame``: the wire.Probe)."""
    frame: wire.Frame


@wire.value()
class Dump(wire.Frame):
    """Print every rank's stack (the controller's Dump, or the supervisor's DumpStacks)."""


@wire.value()
class PassOn(wire.Frame):
    """The controller passes on a signal it got (SIGUSR1, SIGUSR2): to every rank here, straight."""
    name: str


@wire.value()
class Stop(wire.Frame):
    """Stop the job here, for good: the controller's Stop (``force``: its Kill), a signal to this
    agent, a protocol error, or the end we answer to gone silent."""
    reason: str
    force: bool = False
    signalled: bool = False  # a signal to the agent: ddp-kill's (state.killed_by_ddp_kill) or anyone's
    peer_lost: bool = False  # for a node lost (wire.Stop's)


@wire.value()
class ControllerGone(wire.Frame):
    """The controller's connection closed (a detached job goes on without it)."""
    reason: str


@wire.value()
class Exited(wire.Frame):
    """The launcher of attempt ``attempt`` exited with ``code`` (an attempt's end is told apart
    from a later one's)."""
    attempt: int
    code: int | None


@wire.value()
class RanksGone(wire.Frame):
    """Every process of attempt ``attempt`` that outlived its launcher in a stop has ended (or the
    grace is over): the stop is complete here."""
    attempt: int


@wire.value()
class Halt(wire.Frame):
    """The detached job's supervisor stops attempt ``attempt`` here: another node's failure,
    not a stop for good (the job may restart)."""
    attempt: int
    reason: str
    peer_lost: bool = False  # for a node lost (wire.Halt's)


@wire.value()
class WarmAnswered(wire.Frame):
    """The warm interpreter said ready or cold (its imports are over): the node goes on (run.await_warm)."""


@wire.value()
class Restart(wire.Frame):
    """The supervisor starts the next attempt (``frame``: the wire.Restart)."""
    frame: wire.Frame


@wire.value()
class Over(wire.Frame):
    """The supervisor's word that no attempt follows."""
    reason: str


CONTROLLER_ASKED = "stopped by ddp-up"  # a node's detail: in the words users use
FROM_CONTROLLER = {  # run mode: every frame the controller may send after the spec but Heartbeat
    wire.Go: Go,
    wire.Probe: Probe,
    wire.Dump: lambda frame: Dump(),
    wire.Signal: lambda frame: PassOn(frame.name),
    wire.Stop: lambda frame: Stop(CONTROLLER_ASKED, peer_lost=frame.peer_lost is True),
    wire.Kill: lambda frame: Stop(CONTROLLER_ASKED, True),
}


def from_controller(frame):
    """The event for a controller's frame; None for a Heartbeat; a Stop for a frame that has no
    business in run mode (the job must not go on under a controller that speaks another protocol)."""
    make = FROM_CONTROLLER.get(type(frame))
    if make is not None:
        return make(frame)
    if isinstance(frame, wire.Heartbeat):
        return None
    return Stop("protocol error from the controller: %s in run mode" % type(frame).__name__)


def from_supervisor(frame, attempt):
    """The event for the supervisor's frame while this node runs ``attempt``, or None (a
    Heartbeat, or a Restart this node has already begun)."""
    if isinstance(frame, wire.Halt):
        return Halt(attempt, frame.reason, frame.peer_lost is True)
    if isinstance(frame, wire.DumpStacks):
        return Dump()
    if isinstance(frame, wire.Restart):
        return Restart(frame) if frame.attempt > attempt else None
    if isinstance(frame, wire.RunOver):
        return Over(frame.reason)
    return None


def read_controller(stream, post, heard):
    """The controller's frames from ``stream``, as events on ``post``, until it closes
    (ControllerGone) or sends what is not a frame of run mode (a Stop, and no more reading);
    ``heard()`` at every frame, the dead-man switch's clock."""
    while True:
        try:
            frame = wire.read_frame(stream)
        except wire.ProtocolError as e:
            post(Stop("protocol error from the controller: %s" % e))
            return
        except (OSError, ValueError):
            frame = None
        if frame is None:
            break
        heard()
        event = from_controller(frame)
        if event is not None:
            post(event)
        if isinstance(event, Stop) and event.reason != CONTROLLER_ASKED:
            return
    post(ControllerGone("controller connection closed"))
