"""Warm interpreters kept across launches (node/attempt/keep.py), one per node, for as long as this process
wants them: the next `orchestrator.launch()` of a Python session (a notebook's next cell), and the
next attempt of a run that restarts, fork their ranks from an interpreter that imported torch
during an earlier one, before the failure.

A launch's plan gets the kept interpreters' names (LaunchPlan.kept), which its agents ask for by
name; one not ready yet, or gone, is no error: that node starts cold, with a notice. Each keeper
is an agent connection this process holds: it ends when the connection does, at ``close()``, at
this process's exit, or when the kernel closes it (a killed kernel), and when this process is
silent for the cluster's orphan_timeout, as any agent does.
"""

from __future__ import annotations

import atexit
import hashlib
import secrets
import threading
import time
from dataclasses import replace

from ..config.containers import box_code
from ..node.protocol import wire
from ..node.launchers.keptbox import keeps_box
from ..node.local.procs import TAG_KEEP
from ..plan.launch import LaunchPlan, NodePlan
from ..remote.oneshot import AgentCall
from ..remote.parallel import on_each
from ..remote.transports import transport_for

REAP_WAIT = 5.0  # seconds, at the session's end, for the keepers' processes here to end once closed


class Keeper:
    """One node's kept interpreter, as this process holds it: its agent connection."""

    def __init__(self, plan: LaunchPlan, node: NodePlan):
        self.name = secrets.token_hex(8)
        spec = plan.agent_spec(node)  # the interpreter a launch's agent would make: its environment, its imports
        # opened as the launch's agents are: it uses the node's shared connection, never races them to make it
        boxed = dict(container=spec.container, box_code=box_code("boxkeep")) if spec.container else {}
        # in the job's workdir, as a launch's agent: a preload of the user's own (beside the script) is found there
        self.call = AgentCall(node.config, wire.KeepSpec(name=self.name, env=spec.env, preload=spec.preload,
                                                         nproc=spec.nproc, orphan_timeout=spec.orphan_timeout,
                                                         workdir=spec.workdir, **boxed),
                              transport_for(node.config, master=False), setup=True, tags={TAG_KEEP: self.name})

    def open(self) -> bool:
        """Connected and started: it imports while the launch goes on."""
        if self.call.open() is None:
            return True
        self.close()
        return False

    def alive(self) -> bool:
        proc = self.call.channel.proc
        return proc is not None and proc.exit_status(0) is None

    def beat(self) -> None:
        try:
            self.call.send(wire.Heartbeat())
        except OSError:
            pass

    def close(self) -> None:
        self.call.close()

    def reap(self, deadline: float) -> None:
        """Wait, until ``deadline`` at most, for its process here (the local agent, or the ssh
        client) to end after ``close``: this process reaps it, rather than leave it a zombie
        under a first process that does not reap (a container without an init) once this one is gone."""
        proc = self.call.channel.proc
        if proc is not None:
            proc.exit_status(max(0.0, deadline - time.monotonic()))


class Kept:
    """This process's kept interpreters, by node: what a launch's plan is given (``kept(plan)``)."""

    def __init__(self):
        self.keepers: dict[str, Keeper] = {}
        self.lock = threading.Lock()
        self.ended = threading.Event()  # the heartbeats' end
        self.every: float | None = None  # seconds between heartbeats, while keepers run
        atexit.register(self.close)

    def __call__(self, plan: LaunchPlan) -> LaunchPlan:
        """``plan`` with its nodes' kept interpreters (started now where a node has none yet)."""
        if not plan.warms or plan.detach:  # a detached job outlives this process, and so its ranks
            return plan
        wanted = {node.index: (node, fit(plan, node)) for node in plan.nodes  # in a container: kept in one of
                  if node.config.container is None or keeps_box(node.config.container.wire())}  # docker's, podman's
        with self.lock:
            for key in [key for _, key in wanted.values() if key in self.keepers and not self.keepers[key].alive()]:
                self.keepers.pop(key).close()
            new = {key: Keeper(plan, node) for node, key in wanted.values() if key not in self.keepers}
        # each bounded by its connect_timeout; a signal meanwhile is the Job's to act on, next
        opened = on_each(list(new.values()), Keeper.open, inbox=None, name="keep")
        with self.lock:
            for (key, keeper), ok in zip(new.items(), opened):
                if ok and key not in self.keepers:
                    self.keepers[key] = keeper
                elif ok:  # another call made one meanwhile
                    keeper.close()
            if self.every is None:
                self.every, self.ended = plan.heartbeat, threading.Event()
                threading.Thread(target=self.beat, args=(self.ended,), name="kept-heartbeats", daemon=True).start()
            names = {index: self.keepers[key].name for index, (_, key) in wanted.items() if key in self.keepers}
        return replace(plan, kept=names)

    def ahead(self, plan: LaunchPlan) -> None:
        """Start ``plan``'s nodes' interpreters now, in the background, for a later attempt (spares)."""
        threading.Thread(target=self, args=(plan,), name="keep-ahead", daemon=True).start()

    def beat(self, ended: threading.Event) -> None:
        while not ended.wait(self.every):
            with self.lock:
                keepers = list(self.keepers.values())
            for keeper in keepers:
                keeper.beat()

    def close(self) -> None:
        """Every kept interpreter ends (its keeper sees its connection close)."""
        with self.lock:
            closed = list(self.keepers.values())
            for keeper in closed:
                keeper.close()
            self.keepers.clear()
            self.ended.set()
            self.every = None
        deadline = time.monotonic() + REAP_WAIT  # they end at once, together: the wait is the slowest one's
        for keeper in closed:
            keeper.reap(deadline)


def fit(plan: LaunchPlan, node: NodePlan) -> str:
    """What makes a node's interpreter fit a launch: the node, how it is reached, its Python,
    environment, setup and workdir, and what it imports. Not its place in the run (a spare takes
    another's), nor the cluster's id (a dict's cluster is a new file at every launch). Hashed:
    the environment may hold secrets."""
    text = repr((replace(node.config, rank=0, line=None), node.workdir, plan.agent_spec(node).env, plan.preload))
    return hashlib.sha256(text.encode()).hexdigest()
