"""The steps of a job's life that the loop takes one after the other: connect and preflight every
node (await_ready), the checks across nodes (check_nodes), Go to every node at once (go), and at
the end, the channels' own last words (settle). Each turns the job's loop until its step is done
or its deadline passes.
"""

from __future__ import annotations

import os
import re

from ..diagnose import preflight
from ..config.containers import preflight_allowance
from ..errors import NodeProblem, SetupError
from ..node import wire

SETUP_MARGIN = 30.0  # beyond connect_timeout for an agent to preflight and report ready
PROBE_MARGIN = 10.0  # beyond the probe's own timeout for every node to answer it
SETTLE = 2.0  # after the last node's end, for the channels to report theirs (their last stderr lines)


class Phases:
    def __init__(self, job):
        self.job = job  # the Job whose loop they turn

    def await_ready(self) -> list[NodeProblem]:
        job = self.job
        deadline = job.clock() + SETUP_MARGIN + max(n.config.ssh.connect_timeout + preflight_allowance(n.config.container)
                                                    for n in job.plan.nodes)
        while any(s.state == "connecting" for s in job.status):
            if job.clock() >= deadline:
                for s in job.status:
                    if s.state == "connecting":
                        job.table.error(s.plan.index, NodeProblem(s.plan.label, "no ready report from the node "
                                                                   "agent", "check the node's load and filesystem"))
                break
            job.turn(deadline)
        return job.table.problems()

    def check_nodes(self) -> list[NodeProblem]:
        """Across nodes: the same torch as the master, enough GPUs, a real TCP path to the master."""
        job = self.job
        probe = wire.Probe(addr=job.plan.master_addr, port=job.master_port, timeout=preflight.PROBE_TIMEOUT)
        for session in job.sessions:
            session.send(probe)
        deadline = job.clock() + preflight.PROBE_TIMEOUT + PROBE_MARGIN
        while any(s.reach is None for s in job.status) and job.clock() < deadline and not job.stop.requested:
            job.turn(deadline)
        busy, busy_notices = preflight.busy_gpus(job.status, job.plan.allow_busy_gpus)
        problems = preflight.cross_node_problems(job.status, job.plan.master.index,
                                                 f"{job.plan.master_addr}:{job.master_port}", busy)
        notices = preflight.skew_notices(job.status) + busy_notices + \
            preflight.accelerate_notices(job.status, job.plan.script, job.plan.launcher, uses_accelerate(job.plan.script))
        for text in notices + ([] if problems else preflight.interface_notices(job.status)):
            job.view.notice(text)
        return problems

    def go(self) -> None:
        job = self.job
        if job.master_port is None:
            raise SetupError([NodeProblem(job.plan.master.label, "the master did not report a free port")])
        if job.plan.detach and job.supervisor_port is None:
            raise SetupError([NodeProblem(job.plan.master.label, "the master did not report its supervisor's port",
                                          "use the same ddp-up version everywhere")])
        supervisor = [job.plan.master_addr, job.supervisor_port] if job.plan.detach else None
        job.hang.started(job.clock())
        for session, status in zip(job.sessions, job.status):
            session.send(wire.Go(argv=job.plan.launcher_argv(status.plan, job.master_port), supervisor=supervisor,
                                 env=preflight.interface_env(status) or None))
            status.started_at = job.clock()
            job.table.set(status.plan.index, "starting")

    def settle(self) -> None:
        """Every node has ended: let each channel report its own end (within SETTLE), so what its
        stderr said last is read before the result, such as Slurm's word on a step it cancelled."""
        job = self.job
        deadline = job.clock() + SETTLE
        waiting = [i for i, (s, st) in enumerate(zip(job.sessions, job.status))
                   if s.started and st.state in ("done", "failed", "stopped")]  # a lost node's, we closed
        while job.clock() < deadline and any(i not in job.channel_ended for i in waiting):
            job.turn(deadline)


ACCELERATE_IMPORT = re.compile(rb"^[ \t]*(from|import)[ \t]+accelerate\b", re.M)
SCRIPT_READ = 1 << 18  # bytes of a script read to see whether it uses Accelerate


def uses_accelerate(script: str) -> bool:
    """Whether the script, where it is readable here too (a synced or shared checkout), imports
    Accelerate: the start of a regular file, read bounded, never run."""
    try:
        with open(script, "rb") as f:
            return os.path.isfile(script) and ACCELERATE_IMPORT.search(f.read(SCRIPT_READ)) is not None
    except OSError:
        return False
