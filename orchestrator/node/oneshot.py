"""The one-shot modes: ``detect`` (what planning needs to know of the node: its GPU count, for
``gpus: auto``) and ``sweep`` (find tagged processes and stop them: ddp-kill's path, and the
controller's for a node it lost).
"""

import signal

from .launchers import container
from .local.inventory import remove_stale_state
from .local.procs import (KILL_WAIT, find_tagged, is_agent, job_env, job_ranks, kill_tagged, signal_ranks, signal_tagged,
                          wait_gone)
from .local.state import note_kill, remove_quietly
from .probes import facts
from .protocol import wire


def detect(spec, writer):
    """One-shot facts for planning (``gpus: auto``), before any job exists."""
    writer.send(wire.Detected(gpus=facts.count_gpus(job_env(spec.env))))
    writer.drain(5)
    return 0


def sweep(spec, writer):
    match = {k: str(v) for k, v in spec.match.items() if v is not None}
    found = find_tagged(match)
    if spec.signal:
        return signal_sweep(spec, match, found, writer)
    writer.send(wire.Listed(found=found))
    if spec.dry_run:
        result = {"found": found, "killed": [], "left": []}
        removed = remove_stale_state(match, purge=True, dry_run=True) if spec.purge else []
    else:
        result = stop_agents_first(match, spec.grace)
        removed = remove_stale_state(match, purge=spec.purge)
    boxes = container.sweep(spec.runtimes, match, spec.dry_run)  # after the agents: they remove their own first
    writer.send(wire.Swept(killed=result["killed"], left=result["left"], removed=removed, containers=boxes or None))
    writer.drain(5)
    return 0


def signal_sweep(spec, match, found, writer):
    """ddp-kill --signal: the signal to every rank found, straight (a launcher would take it for a
    stop); nothing is stopped. A dry run lists the ranks only."""
    ranks = job_ranks(found)
    writer.send(wire.Listed(found=ranks))
    sent = [] if spec.dry_run else signal_ranks(getattr(signal, spec.signal), match, ranks)
    writer.send(wire.Swept(killed=[], left=[], signalled=sent))
    writer.drain(5)
    return 0


def stop_agents_first(match, grace):
    """kill_tagged, but a detached job's agents first get SIGTERM and ``grace`` to stop their own
    job and record its end (their workers are still there when they look)."""
    agents = [p["pid"] for p in find_tagged(match) if is_agent(p)]
    notes = [note_kill(pid) for pid in agents]  # the signal is ddp-kill's: the run is over, not recovered
    stopped = [pid for pid in agents if signal_tagged(pid, signal.SIGTERM, match)]
    wait_gone(stopped, grace + KILL_WAIT)
    remove_quietly(*[note for note in notes if note])  # an agent that never read its note
    return kill_tagged(match, grace=grace)
