"""Config + script + args -> one launch spec per node. Pure: no I/O, golden-tested.

Script arguments never pass through a shell: the launcher argv travels to the node agent as
JSON and is exec'd directly. ``shell_line`` renders the same argv shell-quoted for --dry-run.
"""

from __future__ import annotations

import secrets
import shlex
import time
from dataclasses import dataclass, field
from typing import Mapping

from ..config.cluster import ClusterConfig, NodeConfig, never, node_workdir, quote_path
from ..config.containers import box_code
from ..config.masking import mask_secrets
from ..errors import UsageError
from ..node.protocol import policy, wire
from ..node.launchers.container import ENV_FILE, Box
from ..node.attempt.placement import (ACCELERATE_NODE_OPTIONS, TORCHRUN_SIGNALS, torchrun_passes_on, unconfigured_options,
                           with_node_options)
from ..node.supervise.notify import DETACHED_KINDS
from ..node.local.procs import TAG_ATTEMPT, TAG_CLUSTER, TAG_JOB, TAG_NODE, TAG_RUN, TORCHRUN
from ..node.local.state import JOB_ID
from ..node.userpython import standin
from ..node.launchers.workers import OWN_LAUNCHER

# What a worker runs under `launcher: legacy`: the script, with --local_rank=N first among its
# arguments, as torch.distributed.launch passed it (scripts parse `--local_rank`, underscore).
LEGACY_SHIM = ("import os, sys; n = 3 if sys.argv[1] == '-m' else 2; os.execv(sys.executable, [sys.executable, "
               "'-u', *sys.argv[1:n], '--local_rank=' + os.environ['LOCAL_RANK'], *sys.argv[n:]])")


@dataclass(frozen=True)
class NodePlan:
    index: int  # node rank
    config: NodeConfig
    first_rank: int
    workdir: str | None
    env: Mapping[str, str]

    @property
    def label(self) -> str:
        return self.config.label

    @property
    def nproc(self) -> int:
        return self.config.gpus

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.nproc)

    def tags(self, plan: LaunchPlan) -> dict[str, str]:
        """Environment that marks every process of this job on this node as ddp-up's."""
        return {TAG_JOB: plan.job_id, TAG_NODE: str(self.index), TAG_CLUSTER: plan.cluster_id, TAG_RUN: plan.run_token,
                TAG_ATTEMPT: str(plan.attempt)}


@dataclass(frozen=True)
class LaunchPlan:
    job_id: str
    cluster_id: str
    master_addr: str
    master_port: int | None  # None until the master node picked one
    nodes: tuple[NodePlan, ...]
    script: str
    script_args: tuple[str, ...]
    orphan_timeout: float
    stop_grace: float
    hang_timeout: float | None = None
    startup_timeout: float | None = None  # config.ClusterConfig's
    stop_signal: str = "SIGTERM"  # a stop's first signal to every rank (config.ClusterConfig's)
    flight_recorder: bool = True  # every rank records its collectives (node/watch/flight.py)
    warm: bool = False  # ranks forked from a warm interpreter (node/launchers/warm.py), where plan.warms
    preload: tuple[str, ...] = ()  # what it imports besides torch
    warm_gpus_only: bool = False  # warm only on nodes with NVIDIA GPUs (ddp-check --gpus)
    kept: Mapping[int, str] = field(default_factory=dict)  # warm: node index -> the session's kept interpreter (run/kept.py)
    launcher: str = "torchrun"
    secrets: frozenset[str] = frozenset()  # values never shown: dry-run, console, logs, dashboard
    run_token: str = ""  # tags this launch's processes apart from any other with the same job id
    detach: bool = False  # the job outlives ddp-up: its agents supervise it (node/supervise/detached.py)
    peer_token: str | None = field(default=None, repr=False)  # detach: the secret the job's agents prove to each other
    retention: float = 7 * 86400.0  # detach: how long its record and logs stay on the nodes after its end
    allow_busy_gpus: bool = False  # start even where other processes hold memory on the job's GPUs
    allow_unhealthy_gpus: bool = False  # start even on GPUs whose health is fatal (diagnose/gpuhealth.py)
    module: str | None = None  # run this module (torchrun -m) instead of the script: one of ``hooks``
    hooks: Mapping[str, str] = field(default_factory=dict)  # file name -> text each agent writes and puts on PYTHONPATH
    attempt: int = 0  # restarts: 0 for the first run, then 1, 2... (DDP_UP_ATTEMPT in every process)
    quarantined: tuple[str, ...] = ()  # restarts: nodes taken out of the run, for the dashboard
    evict_after: float | None = None  # restarts: a node that straggles this long is set aside (pace.py)
    # restarts: nodes whose preflight passed in an earlier attempt and that were not lost since, with
    # the torch build they reported; their agents skip the torch probe (an import of torch, the slow
    # part of a preflight), and the cross-node checks use these facts
    vetted: Mapping[str, Mapping[str, str | None]] = field(default_factory=dict)
    restarts: int = 0  # detach: the restarts its supervisor may make (a run that stays makes its own)
    recoveries: int = 0  # detach: and the recoveries (attempts.recovery_limit)
    no_restart_on_exit: tuple[int, ...] = ()  # detach: exit codes no restart can fix
    restart_delay: float = 10.0  # detach: see RunSpec.restart_delay
    min_nodes: int | None = None  # detach: an elastic job's fewest nodes (its supervisor decides, node/supervise/members.py)
    rejoin_after: float | None = None  # detach, elastic: see RunSpec.rejoin_after (None: never)
    notify: tuple = ()  # notify.Target: who hears of the job's events
    commit: str | None = None  # the local checkout's commit the job ran from (runrecord.py), for ddp-ls
    report: bool = True  # `report:`: the run's timeline kept, and its page written at its end (views/report.py)
    metrics: tuple | None = ()  # `metrics:`: what ranks print read as metrics (diagnose/metrics.py); None: off

    def mask(self, text: str) -> str:
        return mask_secrets(text, self.secrets)

    @property
    def world_size(self) -> int:
        return sum(n.nproc for n in self.nodes)

    def rank_node(self, rank: int) -> str:
        """The node a global rank runs on, as the cluster file names it."""
        return next((n.label for n in self.nodes if rank in n.ranks), "?")

    @property
    def master(self) -> NodePlan:
        """The node that hosts the rendezvous store: the one whose addr is master_addr, else node 0."""
        for node in self.nodes:
            if node.config.addr == self.master_addr or node.config.host == self.master_addr:
                return node
        return self.nodes[0]

    @property
    def heartbeat(self) -> float:
        """Seconds between heartbeats, both ways: several per orphan_timeout, at most 5 s."""
        return round(min(5.0, self.orphan_timeout / 4), 3)

    def launcher_argv(self, node: NodePlan, port: int | str, warm: bool | None = None) -> list[str]:
        """The launcher's command line on ``node``; ``warm=False``: as by hand, cold (shell_line)."""
        cfg = node.config
        warm = self.warms if warm is None else warm
        # `none`: the agent starts the workers itself (node/launchers/workers.py), with what a launcher would get
        if self.launcher == "none":
            return [OWN_LAUNCHER, f"--nproc-per-node={cfg.gpus}", f"--node-rank={node.index}",
                    f"--first-rank={node.first_rank}", f"--world-size={self.world_size}",
                    f"--master-addr={self.master_addr}", f"--master-port={port}", *self._entrypoint(cfg.python),
                    *self.script_args]
        python = cfg.container.python if cfg.container else cfg.python  # the image's, in a container
        if self.launcher == "accelerate":  # `accelerate launch`: it runs torchrun in its own process
            return [python, "-u", "-m", "accelerate.commands.launch", f"--num_machines={len(self.nodes)}",
                    f"--machine_rank={node.index}", f"--num_processes={self.world_size}",
                    f"--main_process_ip={self.master_addr}", f"--main_process_port={port}", "--same_network",
                    ACCELERATE_NODE_OPTIONS, *self._entrypoint(python), *self.script_args]
        return [
            python, "-u", "-m", TORCHRUN,
            f"--nnodes={len(self.nodes)}",
            f"--nproc-per-node={cfg.gpus}",
            f"--node-rank={node.index}",
            f"--master-addr={self.master_addr}",
            f"--master-port={port}",
            "--redirects=3",  # worker output to files on the node, relayed by the agent's tailer
            *self._signals(),
            *self._entrypoint(python, warm),
            *self.script_args,
        ]

    @property
    def warms(self) -> bool:
        """Whether the ranks are forked from a warm interpreter on their node (node/launchers/warm.py): under
        torchrun or ddp-up's own launcher, on the host or in a container (node/launchers/boxwarm.py)."""
        return self.warm and self.launcher in ("torchrun", "none")

    def _signals(self) -> list[str]:
        """torchrun passes on to the ranks only the signals it handles (SIGTERM, SIGINT, SIGHUP,
        SIGQUIT); another stop_signal would kill it, and leave the ranks without one."""
        if self.stop_signal in TORCHRUN_SIGNALS:
            return []
        return [f"--signals-to-handle={','.join(torchrun_passes_on(self.stop_signal))}"]

    def _entrypoint(self, python: str, warm: bool = False) -> list[str]:
        # ddp-up's own program (ddp-check's probes) runs from the hooks, which are on the rank's path
        target = ["-m", self.module] if self.module is not None else [self.script]
        if warm:  # torchrun's worker: a stand-in that asks the node's warm interpreter for the rank; its
            # code attached to -c: torchrun names a failed worker by its first argument not an option
            return ["--no-python", python, "-S", "-c" + standin.LOADER, *target]
        if self.launcher == "legacy" and self.module is None:  # torch.distributed.launch passed --local_rank=N
            return ["--no-python", python, "-u", "-c", LEGACY_SHIM, self.script]
        return target

    def agent_spec(self, node: NodePlan) -> wire.RunSpec:
        """What the node agent needs before go: where to run, what to check, how to stop."""
        is_master = node.index == self.master.index
        detached = dict(detach=True, token=self.peer_token, nodes=len(self.nodes), label=node.label,
                        ranks=[node.first_rank, node.nproc], hang_timeout=self.hang_timeout,
                        startup_timeout=self.startup_timeout,
                        retention=self.retention, restarts=self.restarts, restart_delay=self.restart_delay,
                        recoveries=self.recoveries, no_restart_on_exit=list(self.no_restart_on_exit) or None,
                        master_addr=self.master_addr if is_master else None,
                        secrets=sorted(self.secrets) or None, commit=self.commit,
                        notify=self._detached_notify(node), min_nodes=self.min_nodes,
                        sizes=[n.nproc for n in self.nodes] if self.min_nodes is not None else None,
                        rejoin_after=self.rejoin_after, evict_after=self.evict_after) if self.detach else {}
        return wire.RunSpec(
            job=self.job_id, node=node.index, cluster=self.cluster_id, run=self.run_token, workdir=node.workdir,
            script=self.script,
            env=dict(node.env), pick_port=is_master and self.master_port is None,
            check_port=self.master_port if is_master else None, orphan_timeout=self.orphan_timeout,
            stop_grace=self.stop_grace, stop_signal=self.stop_signal, heartbeat=self.heartbeat,
            stack_dumps=self.hang_timeout is not None or self.startup_timeout is not None,
            flight_recorder=self.flight_recorder,
            warm=self.warms, warm_gpus_only=self.warm_gpus_only, preload=list(self.preload) or None,
            keep=self.kept.get(node.index),
            needs_torch=self.launcher != "none" and node.label not in self.vetted, nproc=node.nproc,
            hooks=dict(self.hooks) or None, attempt=self.attempt,
            container=node.config.container.wire() if node.config.container else None,
            box_code=code_in_image(self, node), **detached)

    def _detached_notify(self, node: NodePlan) -> list | None:
        """The webhook and command targets, for the master node (its supervisor's events) and one
        other, the first (it tells when the supervisor is lost for good); no other node has them."""
        witness = next((n.index for n in self.nodes if n.index != self.master.index), None)
        if node.index not in (self.master.index, witness):
            return None
        return [t.wire() for t in self.notify if t.kind in DETACHED_KINDS] or None

    def shell_line(self, node: NodePlan, port: int | str) -> str:
        """The launch as one copy-pasteable shell line (for --dry-run and error reports): cold, as
        a user would type it (a warm launch's torchrun runs stand-ins for its ranks, see node/userpython/standin.py)."""
        argv = self.launcher_argv(node, port, warm=False)
        env = {**node.tags(self), **node.env}
        if ACCELERATE_NODE_OPTIONS in argv:  # as a node without an accelerate config of its own runs it
            argv = with_node_options(argv, unconfigured_options(env))
        if node.config.container:
            return self.mask(self.container_lines(node, argv, env))
        parts = [f"cd {quote_path(node.workdir or '~')}", "&&", "env"]
        parts += [f"{k}={display_quote(v)}" for k, v in env.items()]
        parts += [quote_path(argv[0]), *(display_quote(a) for a in argv[1:])]
        return self.mask(" ".join(parts))


    def container_lines(self, node: NodePlan, argv: list[str], env: dict[str, str]) -> str:
        """The container's run command, as the node's agent builds it (its uid, and the GPUs of a
        node with NVIDIA GPUs), and the environment it reads from a private file, not a command line."""
        cfg = node.config
        state = f"$TMPDIR/ddp-up-$UID/{self.job_id}/node{node.index}"
        box = Box(cfg.container.wire(), node.tags(self), node.workdir or "~", binds=(state,),
                  gpus=[str(i) for i in range(node.nproc)], user=("$UID", "$GID"))
        command = box.run_argv(argv, f"{state}/{ENV_FILE}")
        return "\n".join([f"# in {state}/{ENV_FILE} (0600), read by the container's first process: "
                          + " ".join(f"{k}={display_quote(v)}" for k, v in env.items()),
                          " ".join(display_quote(a) for a in command)])


@dataclass(frozen=True)
class Attempt:
    """Which attempt of a run a plan is for, and what the run has learnt by then (restarts:)."""

    number: int = 0  # 0 for the first run, then 1, 2... (DDP_UP_ATTEMPT in every process)
    quarantined: tuple[str, ...] = ()  # nodes taken out of the run
    evict_after: float | None = None  # `evict_after:`, where a spare or min_nodes lets the run do without a node
    vetted: Mapping[str, Mapping[str, str | None]] = field(default_factory=dict)  # see LaunchPlan.vetted


FIRST = Attempt()


def code_in_image(plan: LaunchPlan, node: NodePlan) -> dict | None:
    """The node code a container's first process runs in the image: the launcher that starts the
    warm interpreter there (node/launchers/boxwarm.py), with, for a detached job that restarts, its kept
    container's (node/launchers/boxkeep.py), or `launcher: none`'s workers started cold; None on the host."""
    if node.config.container is None or not (plan.launcher == "none" or plan.warms):
        return None
    if plan.warms and policy.runs_every_attempt(plan):
        return box_code("boxkeep")
    return box_code("boxwarm" if plan.warms else "workers")


def warm_start(config: ClusterConfig) -> bool:
    """`warm:` as the cluster file says, or its default: on under torchrun, whose nodes have torch and
    whose ranks are a torch job's, and wherever `preload:` names what to import; off under
    `launcher: none`, which may start any program (a node with no torch would import it in vain)."""
    if config.warm is not None:
        return config.warm
    return config.launcher == "torchrun" or bool(config.preload)


def warm_refused(config: ClusterConfig, plan: LaunchPlan) -> str | None:
    """What a cluster file that says `warm: true` is told where its ranks start cold anyway (the
    default says nothing: it asked for nothing): once, so that a cold start is not taken for a warm one."""
    if config.warm is not True or plan.warms or plan.module is not None:
        return None
    return (f"warm: true does not apply under `launcher: {plan.launcher}`, which starts the ranks itself: "
            "the ranks start cold there (see the warm start guide)")


def make_plan(config: ClusterConfig, script: str, script_args: list[str] | tuple[str, ...],
              job_id: str, local_cwd: str, hang_timeout: float | None = None,
              run_token: str | None = None, detach: bool = False,
              allow_busy_gpus: bool = False, allow_unhealthy_gpus: bool = False,
              attempt: Attempt = FIRST, restarts: int = 0, recoveries: int = 0, commit: str | None = None) -> LaunchPlan:
    """Assign node ranks (file order) and contiguous global ranks; resolve per-node settings.
    ``restarts``: with ``detach``, how many times the job's own supervisor may start it again
    (a run that stays makes its own restarts, each attempt a plan of its own)."""
    if config.launcher == "accelerate" and len({cfg.gpus for cfg in config.nodes}) > 1:
        raise UsageError("launcher: accelerate starts the same number of processes on every node (accelerate "
                         "launch takes their total): give every node the same `gpus:`, or use `launcher: torchrun`")
    nodes = []
    first = 0
    for cfg in config.nodes:
        nodes.append(NodePlan(index=cfg.rank, config=cfg, first_rank=first, workdir=node_workdir(cfg, local_cwd),
                              env=dict(cfg.env)))
        first += cfg.gpus
    return LaunchPlan(
        job_id=job_id,
        cluster_id=config.cluster_id,
        master_addr=config.master_addr,
        master_port=config.master_port,
        nodes=tuple(nodes),
        script=script,
        script_args=tuple(script_args),
        orphan_timeout=config.orphan_timeout,
        stop_grace=config.stop_grace,
        stop_signal=config.stop_signal,
        flight_recorder=config.flight_recorder,
        warm=warm_start(config),
        preload=config.preload,
        hang_timeout=hang_timeout if hang_timeout is not None else config.hang_timeout,
        startup_timeout=config.startup_timeout,
        launcher=config.launcher,
        secrets=config.secret_values,
        run_token=run_token if run_token is not None else secrets.token_hex(6),
        detach=detach,
        peer_token=secrets.token_hex(32) if detach else None,
        retention=config.retention,
        allow_busy_gpus=allow_busy_gpus, allow_unhealthy_gpus=allow_unhealthy_gpus,
        attempt=attempt.number,
        quarantined=attempt.quarantined, evict_after=config.evict_after if detach else attempt.evict_after,
        vetted=dict(attempt.vetted),
        restart_delay=config.restart_delay,
        notify=config.notify,
        commit=commit, report=config.report and not detach, metrics=config.metrics,
        **(supervised(config, restarts, recoveries) if detach else {}),
    )


def supervised(config: ClusterConfig, restarts: int, recoveries: int) -> dict:
    """A detached job's own restarts, as its supervisor makes them (the rest of a run that stays
    makes its own: each attempt a plan of its own)."""
    return dict(restarts=restarts, recoveries=recoveries, no_restart_on_exit=tuple(config.no_restart_on_exit),
                min_nodes=config.min_nodes, rejoin_after=None if never(config.rejoin_after) else config.rejoin_after)


def check_job_id(value: str, flag: str) -> str:
    """``value`` if it is a plain job name; UsageError (exit 2) otherwise."""
    if not JOB_ID.fullmatch(value):
        raise UsageError(f"{flag} {value[:80]!r}: a job id is 1-64 letters, digits, '.', '_' or '-', "
                         "starting with a letter or digit")
    return value


def new_job_id(now: float | None = None, token: str | None = None) -> str:
    """Sortable and unique enough to share nodes: ``20261122-064501-3f9a2c``."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(time.time() if now is None else now))
    return f"{stamp}-{token or secrets.token_hex(3)}"


def display_quote(value: str) -> str:
    """shlex.quote, but control characters become a visible bash $'\\xNN' string."""
    if value.isprintable():
        return shlex.quote(value)
    body = "".join(c if c.isprintable() and c not in "\\'" else f"\\x{ord(c):02x}" for c in value)
    return f"$'{body}'"
