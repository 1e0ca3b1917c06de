"""Command-line shells for ddp-up, ddp-check and ddp-kill.

The only layer that turns exceptions into exit statuses; the code below it reports problems as
values or DdpUpError subclasses that render themselves. Signals are recorded by signals.py; the
shells read the inbox between start-up steps (and the parallel calls while they wait), the job
loop at every turn.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import replace
from functools import partial

from rich.console import Console
from rich.table import Table
from rich.text import Text

from . import __version__, collective, signals
from .attempts import AttemptRecord, Restarts, attempt_record, blame, blame_setup, delay_before, wait_for_signal
from .cleanup import SweepReport, match_for, sweep_nodes
from .config import NodeSource, SyncConfig, load_cluster, read_text
from .detect import resolve_auto_gpus
from .errors import (EXIT_INTERNAL, EXIT_JOB_FAILED, EXIT_OK, EXIT_SETUP, EXIT_USAGE, DdpUpError,
                     Interrupted, SetupError, UsageError)
from .hostlists import parse_host_list, parse_hostfile, slurm_nodes
from .job import Job
from .nodefacts import IFNAME_VARS
from .openssh import CONTROL
from .outcome import JobResult
from .parallel import interruptible
from .plan import LaunchPlan, check_job_id, make_plan, mask_secrets, new_job_id
from .preflight import torch_versions
from .sbatch import split_sbatch, submit
from .sync import Tree, human_bytes, scan, sync_all, targets
from .transport import ssh_facts
from .views.console import ConsoleView, safe_text, terminal_console
from .views.dashboard import DashboardView
from .views.fanout import Fanout
from .views.filters import parse_ranks
from .views.logfiles import RunLogs
from .views.transfer import transfer_progress


# --- ddp-up ---------------------------------------------------------------------------------

def up_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ddp-up",
        usage="ddp-up [options] CLUSTER.yaml SCRIPT [SCRIPT ARGS...]\n"
              "       ddp-up [options] (--hostfile FILE | -H HOST:N,... | --slurm) [CLUSTER.yaml] SCRIPT [ARGS...]\n"
              "       ddp-up --sbatch [SBATCH OPTIONS] [--] CLUSTER.yaml SCRIPT [ARGS...]   (a batch job running "
              "--slurm)",
        description="Launch a multi-node torchrun job over SSH; every remote process it starts is stopped on exit.",
        epilog="Everything after SCRIPT is passed to the script verbatim. Exit status: 0 ok, 1 job failed, "
               "2 bad config or usage, 3 a node could not be set up (nothing started), 70 internal error, "
               "128+N killed by signal N.")
    p.add_argument("cluster", metavar="CLUSTER.yaml", help="cluster file (see configs/); with a node "
                   "option below, optional and used for its other settings")
    p.add_argument("script", metavar="SCRIPT", nargs="?", help="training script, resolved in each node's workdir")
    add_node_sources(p)
    p.add_argument("--dry-run", action="store_true", help="print the command for every node; connect to nothing")
    sync = p.add_mutually_exclusive_group()
    sync.add_argument("--sync", dest="sync", action="store_true", default=None,
                      help="first copy the cluster file's `sync:` directory, else this directory, to every node's "
                           "workdir (changed files only; .gitignore honored; nothing on the nodes is deleted)")
    sync.add_argument("--no-sync", dest="sync", action="store_false", help="skip the cluster file's `sync:`")
    p.add_argument("--job-id", help="use this job id instead of a generated one")
    p.add_argument("--detach", action="store_true",
                   help="start the job, then exit once every node runs: the job goes on without ddp-up (its "
                        "nodes stop each other on a failure); watch it with ddp-attach, ddp-logs, ddp-ls")
    add_view_options(p)
    p.add_argument("--hang-timeout", type=float, metavar="SECONDS",
                   help="declare the job hung after this long without output from any rank (or with some "
                        "nodes finished and others still running): dump every rank's stack, then stop")
    p.add_argument("--restarts", type=int, metavar="N",
                   help="after a failure, stop every node and start the whole job again, up to N times "
                        "(overrides `restarts:`; each process sees DDP_UP_ATTEMPT)")
    p.add_argument("--no-preflight", dest="preflight", action="store_false",
                   help="skip the cross-node checks (same torch everywhere, every node reaches the master, "
                        "other processes on the GPUs) and the choice of network interface they make")
    p.add_argument("--allow-busy-gpus", action="store_true",
                   help="start even where other processes hold memory on the job's GPUs (listed as a notice)")
    p.add_argument("--runs-dir", default="runs", metavar="DIR",
                   help="where each job's logs and summary.json go (DIR/<job-id>/; default: runs)")
    p.add_argument("--version", action="version", version=f"ddp-up {__version__}")
    return p


def add_view_options(p: argparse.ArgumentParser) -> None:
    """How a job is shown (ddp-up and ddp-attach): dashboard or lines, which ranks, collapsed."""
    view = p.add_mutually_exclusive_group()
    view.add_argument("--no-dashboard", dest="dashboard", action="store_false", default=None,
                      help="plain prefixed lines even on a terminal")
    view.add_argument("--dashboard", dest="dashboard", action="store_true",
                      help="the live dashboard even when stdout is not a terminal")
    p.add_argument("--ranks", metavar="LIST", help="show only these ranks on the console, e.g. 0,3-5 "
                                                   "(log files keep every rank)")
    p.add_argument("--collapse", action="store_true", help="print a line that every rank printed once, with a count")


def make_view(plan: LaunchPlan, console: Console, args: argparse.Namespace, plain=None) -> ConsoleView:
    """The view the view options ask for: the dashboard on a terminal (or when forced), else
    ``plain`` lines (ConsoleView unless given)."""
    ranks = parse_ranks(args.ranks, plan.world_size) if args.ranks else None
    dashboard = console.is_terminal if args.dashboard is None else args.dashboard
    if dashboard and not console.is_terminal:
        console = terminal_console(force_terminal=True)
    return (DashboardView if dashboard else plain or ConsoleView)(plan, console, ranks=ranks, collapse=args.collapse)


NODE_SOURCE_FLAGS = ("--hostfile", "-H", "--slurm")


def add_node_sources(p: argparse.ArgumentParser) -> None:
    nodes = p.add_argument_group("nodes from elsewhere (instead of the cluster file's `nodes:`)")
    one = nodes.add_mutually_exclusive_group()
    one.add_argument("--hostfile", metavar="FILE", help="MPI/DeepSpeed hostfile: `HOST slots=N` lines, # comments")
    one.add_argument("-H", dest="hosts", metavar="HOST:N,...", help="horovod-style list, e.g. gpu-a:8,gpu-b:8")
    one.add_argument("--slurm", action="store_true",
                     help="the nodes of the current Slurm allocation, its GPUs per node, port 15000 + job id %% 10000")


def node_source(args: argparse.Namespace) -> NodeSource | None:
    if args.hostfile:
        text = read_text(args.hostfile, "hostfile")
        return NodeSource(f"--hostfile {args.hostfile}", args.hostfile, parse_hostfile(text, args.hostfile))
    if args.hosts:
        return NodeSource(f"-H {args.hosts}", "", parse_host_list(args.hosts))
    if args.slurm:
        nodes, port = slurm_nodes(os.environ)
        return NodeSource("--slurm", "", nodes, master_port=port, transport="srun")
    return None


def _is_cluster_file(arg: str) -> bool:
    return arg.endswith((".yaml", ".yml"))


def cluster_and_script(first: str | None, second: str | None, has_source: bool) -> tuple[str | None, str | None]:
    """With nodes from elsewhere the cluster file is optional: a lone positional is the script
    unless it names a .yaml/.yml file."""
    if has_source and second is None and first is not None and not _is_cluster_file(first):
        return None, first
    return first, second


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """Our options and our positionals (cluster file and script: one of them may be left out when
    a node option comes first), then the script's arguments untouched."""
    ours, positionals, wanted = [], 0, 2
    takes_value = {"--job-id", "--ranks", "--runs-dir", "--hang-timeout", "--hostfile", "-H", "--restarts"}
    i = 0
    while i < len(argv) and positionals < wanted:
        arg = argv[i]
        ours.append(arg)
        if arg == "--":
            ours.pop()
            ours.extend(argv[i + 1:i + 1 + wanted - positionals])
            i += 1 + wanted - positionals
            break
        if arg in takes_value and i + 1 < len(argv):
            ours.append(argv[i + 1])
            i += 1
        elif not arg.startswith("-") or arg == "-":
            positionals += 1
            if positionals == 1 and any(f in ours for f in NODE_SOURCE_FLAGS) \
                    and not _is_cluster_file(arg):
                wanted = 1  # no cluster file: this is the script
        i += 1
    return ours, argv[i:]


def main_up(argv: list[str] | None = None) -> int:
    with signals.recording() as inbox, ssh_connections():
        return _up(sys.argv[1:] if argv is None else argv, inbox)


@contextmanager
def ssh_connections():
    """The run's shared SSH connections (openssh client) end with the command."""
    try:
        yield
    finally:
        CONTROL.close()


def _up(argv: list[str], inbox: signals.SignalInbox) -> int:
    try:
        sbatch_options, argv = split_sbatch(argv)
    except UsageError as e:
        return _report("ddp-up", e)
    ours, script_args = split_argv(argv)
    args = up_parser().parse_args(ours)
    console = terminal_console()
    secrets: frozenset[str] = frozenset()  # known once the cluster file is read; masked in every message
    if sbatch_options is not None:
        return _submit(args, argv, sbatch_options, console)
    try:
        if args.job_id is not None:
            check_job_id(args.job_id, "--job-id")  # before anything is read or reached
        source = node_source(args)
        args.cluster, args.script = cluster_and_script(args.cluster, args.script, source is not None)
        if args.script is None:
            raise UsageError("missing SCRIPT: ddp-up [options] CLUSTER.yaml SCRIPT [SCRIPT ARGS...]")
        config = load_cluster(args.cluster, source)
        secrets = config.secret_values
        if args.hang_timeout is not None and not 0 < args.hang_timeout < float("inf"):
            raise UsageError("--hang-timeout must be a number of seconds > 0")
        inbox.check()
        if args.restarts is not None and args.restarts < 0:
            raise UsageError("--restarts must be an integer >= 0")
        if args.detach and (config.spares or config.min_nodes is not None):
            raise UsageError("--detach: spares and min_nodes need ddp-up to stay (it starts a spare's agent; a "
                             "detached job's own agents restart it only on the nodes they run on): run without "
                             "--detach, or leave out `spares:` and `min_nodes:` (`restarts:` alone works detached)")
        if args.detach and any(n.transport == "srun" for n in config.nodes):
            raise UsageError("--detach: a job reached through srun ends with its allocation, which ends with "
                             "this command; to run without a terminal, submit it: ddp-up --sbatch [SBATCH OPTIONS] "
                             "CLUSTER.yaml SCRIPT ... (or set `transport: ssh`)")
        config = _resolve_nodes(config, console)
        job_id = args.job_id or new_job_id()
        restarts = Restarts.of(config, args.restarts, planner=lambda cluster: make_plan(
            cluster, args.script, script_args, job_id, os.getcwd(), hang_timeout=args.hang_timeout,
            detach=args.detach, allow_busy_gpus=args.allow_busy_gpus))
        plan = restarts.plan(restarts.first_cluster(), 0)
        if args.detach:  # its restarts are its supervisor's (agent.Supervisor), not this loop's
            plan = replace(plan, restarts=restarts.limit, restart_delay=restarts.delay)
        sync = sync_choice(args.sync, config.sync)
        if args.dry_run:
            print_dry_run(plan, console, interruptible(lambda: scan(sync, skip=[args.runs_dir])) if sync else None,
                          spares=[n.label for n in restarts.roster.spares])
            return EXIT_OK
        if sync:
            copy_workdirs(plan, sync, args.runs_dir, config.path, console)
        view = make_view(plan, console, args)
        inbox.check()
        return run_job(plan, view, RunLogs(plan, args.runs_dir, warn=view.notice), preflight=args.preflight,
                       inbox=inbox, cluster_arg=shlex.join(ours_for_attach(args)),
                       restarts=restarts if restarts.limit and not args.detach else None)
    except DdpUpError as e:
        return _report("ddp-up", e, secrets)
    except Interrupted as e:  # before any job existed: the one-shot calls are closed, nothing to stop
        return _interrupted("ddp-up", e, "before the job started; nothing was started")
    except Exception:  # noqa: BLE001 - a bug: show it, and say what happened to the job
        err = Console(stderr=True, highlight=False, soft_wrap=True)
        err.print_exception()
        err.print("[bold red]ddp-up: internal error[/] (a bug; please report it). Connections were closed, "
                  "so every node stops its job by itself; `ddp-kill CLUSTER.yaml` confirms.")
        return EXIT_INTERNAL


def _submit(args: argparse.Namespace, argv: list[str], sbatch_options: list[str], console: Console) -> int:
    """--sbatch: a batch job that runs this very command with --slurm in its allocation."""
    try:
        if args.detach or args.dry_run or args.hostfile or args.hosts:
            raise UsageError("--sbatch runs the job with --slurm in its own allocation: leave out --detach, "
                             "--dry-run, --hostfile and -H")
        if args.script is None:
            raise UsageError("missing SCRIPT: ddp-up --sbatch [SBATCH OPTIONS] CLUSTER.yaml SCRIPT [ARGS...]")
        if args.cluster and not os.path.isfile(args.cluster):
            raise UsageError(f"{args.cluster}: no such cluster file")
        job_id = args.job_id or new_job_id()
        rest = [a for a in argv if a != "--slurm"]
        if args.job_id is None:
            rest = ["--job-id", job_id, *rest]
        slurm_job, script = submit(sbatch_options, rest, job_id, args.runs_dir)
    except DdpUpError as e:
        return _report("ddp-up", e)
    console.print(f"ddp-up: submitted Slurm job {slurm_job} ({script}); it runs ddp-up job {job_id} with --slurm. "
                  f"Run logs: {os.path.join(args.runs_dir, job_id)}/; ddp-up's own output: sbatch's output file "
                  f"(slurm-{slurm_job}.out unless --output says otherwise). Stop it: scancel {slurm_job}",
                  markup=False, highlight=False)
    return EXIT_OK


def _interrupted(prog: str, e: Interrupted, what: str) -> int:
    Console(stderr=True, highlight=False, soft_wrap=True).print(
        f"{prog}: {signal.Signals(e.signum).name} {what}", markup=False)
    return 128 + e.signum


def _resolve_nodes(config, console: Console):
    """SSH config aliases -> the addresses other nodes use (and a note where the user's SSH
    config trusts new host keys); then ask `gpus: auto` nodes for their count (a short, bounded
    call; nothing is started)."""
    facts = ssh_facts(list(config.nodes))
    config = config.with_addresses({host: f.hostname for host, f in facts.items() if f.hostname != host})
    for strict in ("accept-new", "no"):
        hosts = [host for host, f in facts.items() if f.strict == strict]
        if hosts:
            console.print(f"ddp-up: note: your SSH config sets StrictHostKeyChecking {strict} for "
                          f"{_some(hosts)}: a host key seen for the first time is trusted and recorded "
                          "without checking", markup=False, highlight=False)
    return resolve_auto_gpus(config)


def _some(hosts: list[str], shown: int = 3) -> str:
    return ", ".join(hosts[:shown]) + (f" and {len(hosts) - shown} more" if len(hosts) > shown else "")


def sync_choice(flag: bool | None, configured: SyncConfig | None) -> SyncConfig | None:
    """--sync: the cluster file's `sync:`, else the current directory; --no-sync: none."""
    if flag is None:
        return configured
    return (configured or SyncConfig(src=os.getcwd())) if flag else None


def copy_workdirs(plan: LaunchPlan, sync: SyncConfig, runs_dir: str, config_path: str, console: Console) -> None:
    """The changed files of ``sync``'s tree (ddp-up's runs directory left out) to every node's
    workdir, before anything starts."""
    summary = sync_all(lambda: scan(sync, skip=[runs_dir]), targets(plan, sync.src, config_path),
                       partial(transfer_progress, console))
    console.print(f"ddp-up {summary.render()}", markup=False)


def ours_for_attach(args: argparse.Namespace) -> list[str]:
    """How the other commands name this run's nodes: the cluster file, or the node option."""
    if args.hostfile:
        return ["--hostfile", args.hostfile] + ([args.cluster] if args.cluster else [])
    if args.hosts:
        return ["-H", args.hosts] + ([args.cluster] if args.cluster else [])
    if args.slurm:
        return ["--slurm"] + ([args.cluster] if args.cluster else [])
    return [args.cluster]


def run_job(plan: LaunchPlan, console_view: ConsoleView, logs: RunLogs, preflight: bool = True,
            inbox: signals.SignalInbox = signals.INBOX, cluster_arg: str = "CLUSTER.yaml",
            restarts: Restarts | None = None) -> int:
    """Run to completion. Signals are the job loop's events: the first stops every node
    gracefully, the second kills now; either way the exit status is 128+N. A detached job's run
    ends once every node runs (exit 0), the job going on under its own agents. With
    ``restarts``, a failed attempt is followed by the next one (attempts.py) until one succeeds or none is left."""
    views = Fanout(console_view, logs)
    records: list[AttemptRecord] = []
    swept_later: list[Job] = []  # attempts whose lost nodes are still being swept: the next one need not wait
    with console_view, logs:
        while True:
            job = Job(plan, views, preflight=preflight, inbox=inbox)
            started = time.time()
            result, cause = run_attempt(job, plan, views, logs, records, restarting=restarts is not None)
            swept_later.append(job)
            if job.detached:
                return detached_notices(plan, console_view, cluster_arg)
            records.append(attempt_record(plan, result, started, cause))
            if restarts is not None:
                restarts.vet(job.status)
            if restarts is None or result.exit_code == 0 or result.interrupted:
                break
            following, signum = next_attempt(plan, cause, restarts, views, inbox, records[-1])
            if signum is not None:
                result = replace(result, interrupted=signum)
            if following is None:
                break
            plan = following
            views.attempt(plan)
        for job in swept_later:
            job.report_sweeps()
        logs.finished(result, attempts=records)
        console_view.finished(result, attempts=records)
    console_view.notice(f"logs: {logs.dir}")
    return result.exit_code


def run_attempt(job: Job, plan: LaunchPlan, views, logs: RunLogs, records: list[AttemptRecord],
                restarting: bool) -> tuple[JobResult, tuple[str | None, bool]]:
    """One attempt to its end: its result and what to blame. Re-raises what ends the run at once:
    a bug, or a setup error of the first attempt (a later one's, a spare not fit to run, is that
    attempt's failure: the next one may do without it)."""
    try:
        result = job.run()
    except SetupError as e:
        job.close()
        if not restarting or plan.attempt == 0:
            logs.finished(job.result(), exit_code=e.exit_code, attempts=records)
            raise
        views.notice(f"attempt {plan.attempt} could not start: {e.problems[0].render()}")
        return replace(job.result(), failures=()), blame_setup(e.problems)
    except BaseException as e:  # a bug: record it and give the terminal back
        job.close()
        logs.finished(job.result(), exit_code=getattr(e, "exit_code", EXIT_INTERNAL), attempts=records)
        raise
    job.close(sweeps=not restarting)
    return result, blame(result)


def next_attempt(plan: LaunchPlan, cause: tuple[str | None, bool], policy: Restarts, views,
                 inbox: signals.SignalInbox, last: AttemptRecord) -> tuple[LaunchPlan | None, int | None]:
    """The plan of the attempt after ``plan`` (None: no more), after its delay; and the signal
    that ended the wait, if one did (a signal ends the run for good)."""
    cluster, notice = policy.after(plan.attempt, cause)
    if notice:
        views.notice(notice)
    if cluster is None:
        return None, None
    delay = delay_before(plan.attempt + 1, policy.delay)
    views.notice(f"attempt {plan.attempt} failed ({last.root_cause or 'see above'}); attempt {plan.attempt + 1} "
                 f"of {policy.limit} restart(s) in {delay:g} s (Ctrl-C stops for good)")
    signum = wait_for_signal(inbox, delay)
    if signum is not None:
        views.notice(f"{signal.Signals(signum).name} while waiting to restart: no new attempt")
        return None, signum
    return policy.plan(cluster, plan.attempt + 1), None


def detached_notices(plan: LaunchPlan, console_view: ConsoleView, cluster_arg: str) -> int:
    console_view.end_lines()
    for text in (f"job {plan.job_id} runs detached on {len(plan.nodes)} node(s); it no longer needs this "
                 "terminal",
                 f"watch it: ddp-attach {cluster_arg} {plan.job_id}    (Ctrl-C there leaves it running)",
                 f"its lines: ddp-logs {cluster_arg} {plan.job_id} [--follow]; every job: ddp-ls {cluster_arg}",
                 f"stop it:   ddp-kill {cluster_arg} --job {plan.job_id}"):
        console_view.notice(text)
    if plan.restarts:
        console_view.notice(f"on a failure its own agents start it again, up to {plan.restarts} time(s) "
                            "(restarts:; ddp-ls shows the attempt)")
    return EXIT_OK


def print_dry_run(plan: LaunchPlan, console: Console, tree: Tree | None = None, spares: list[str] = ()) -> None:
    port = plan.master_port if plan.master_port is not None else "<auto: a free port on the master>"
    console.print(f"# job {plan.job_id}: {len(plan.nodes)} node(s), world size {plan.world_size}, "
                  f"master {plan.master_addr}:{port}", markup=False)
    if tree is not None:
        console.print(f"# sync {tree.root} -> each node's workdir: {len(tree.entries):,} files, "
                      f"{human_bytes(tree.size)} (after .gitignore and exclude); only changed files are copied",
                      markup=False)
    unset = [var for var in IFNAME_VARS if any(var not in n.env for n in plan.nodes)]
    if unset:
        console.print(f"# at launch, on each node: {' and '.join(unset)}=<the interface its route to "
                      f"{plan.master_addr} takes>, unless the node's environment sets it (checked first: "
                      "one that cannot reach the master is refused)", markup=False)
    for node in plan.nodes:
        cfg = node.config
        via = "local" if cfg.transport == "local" else f"srun -w {cfg.host}" if cfg.transport == "srun" else \
            f"ssh {cfg.ssh.user + '@' if cfg.ssh.user else ''}{cfg.host}" + (f" -p {cfg.ssh.port}" if cfg.ssh.port else "")
        ranks = f"{node.ranks.start}-{node.ranks.stop - 1}"
        console.print(f"# node {node.index} {node.label} ({via}), ranks {ranks}", markup=False)
        console.print(plan.shell_line(node, port), markup=False)
    if spares:
        console.print(f"# spares, idle until a node is out: {', '.join(spares)}", markup=False)


# --- ddp-check ------------------------------------------------------------------------------

def check_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ddp-check",
        description="Check every node in parallel without starting anything: SSH login and host key, python, "
                    "torch (same version everywhere), workdir and script, master port, a real TCP connection "
                    "from every node to master addr:port, clock skew, free disk, GPUs.")
    p.add_argument("cluster", metavar="CLUSTER.yaml", nargs="?", help="optional with a node option below")
    p.add_argument("script", metavar="SCRIPT", nargs="?", help="also check it exists on every node")
    p.add_argument("--collective", action="store_true",
                   help="after the checks, run a short real all_reduce across the nodes (NCCL on GPUs, else gloo) "
                        "and time every node's link; nodes far slower than the median are named (exit 3)")
    add_node_sources(p)
    return p


class _QuietView:
    """ddp-check shows a table at the end, not the nodes' chatter."""

    def __init__(self, console: Console):
        self.console = console

    def lines(self, node, lines) -> None:
        pass

    def node_state(self, status) -> None:
        pass

    def tick(self, snapshot) -> None:
        pass

    def notice(self, text: str) -> None:
        self.console.print(f"ddp-check {text}", markup=False)


def main_check(argv: list[str] | None = None) -> int:
    args = check_parser().parse_args(sys.argv[1:] if argv is None else argv)
    console = terminal_console()
    config = _load_or_report(args, "ddp-check", script_too=True)
    if config is None:
        return EXIT_USAGE
    with signals.recording() as inbox, ssh_connections():
        try:
            config = _resolve_nodes(config, console)
        except SetupError as e:
            return _report("ddp-check", e, config.secret_values)
        except Interrupted as e:
            return _interrupted("ddp-check", e, "while checking; nothing was started")
        if args.collective:
            return check_collective(config, console, inbox)
        plan = make_plan(config, args.script or "", [], new_job_id(), os.getcwd())
        job = Job(plan, _QuietView(console), inbox=inbox)
        try:
            problems = job.check()
        finally:
            job.close()
        if job.interrupted:
            return _interrupted("ddp-check", Interrupted(job.interrupted), "while checking; nothing was started")
    console.print(check_table(job.status, problems, job.master_port))
    for p in problems:
        console.print(Text("✗ ", style="bold red") + Text(safe_text(mask_secrets(p.render(), config.secret_values))))
    return EXIT_SETUP if problems else EXIT_OK


class _ProbeView(_QuietView):
    """Keeps the probe's report, and the last lines of each node for when there is none."""

    def __init__(self, console: Console):
        super().__init__(console)
        self.report: dict | None = None
        self.last: dict[int, list[str]] = {}

    def lines(self, node, lines) -> None:
        for line in lines:
            report = collective.read_report(line.text) if line.rank == 0 else None
            if report is not None:
                self.report = report
            else:
                self.last[node.index] = (self.last.get(node.index, []) + [line.text])[-8:]


def check_collective(config, console: Console, inbox: signals.SignalInbox) -> int:
    """The preflight of a launch, then the probe job (collective_probe.py), then its tables."""
    plan = collective.probe_plan(config, new_job_id(), os.getcwd())
    view = _ProbeView(console)
    job = Job(plan, view, inbox=inbox)
    console.print(f"ddp-check: all_reduce and every node's link across {len(plan.nodes)} nodes, one process each",
                  markup=False, highlight=False)
    try:
        result = job.run()
    except SetupError as e:
        return _report("ddp-check", e, config.secret_values)
    finally:
        job.close()
    if job.interrupted:
        return _interrupted("ddp-check", Interrupted(job.interrupted), "while measuring; every node stopped its part")
    if view.report is None:
        cause = result.root_cause
        console.print(Text(f"ddp-check: the collective probe failed: {cause.render() if cause else 'no report'}",
                           style="bold red"))
        node = cause.node if cause else 0
        for text in view.last.get(node, []):
            console.print(Text(f"  {safe_text(plan.mask(text))}"))
        return EXIT_JOB_FAILED
    console.print(collective.render(view.report, [n.label for n in plan.nodes]))
    slow = collective.slow_nodes(collective.node_links(view.report))
    for node in slow:
        console.print(Text("✗ ", style="bold red") + Text(
            f"{plan.nodes[node].label}: its link is far slower than the other nodes' (under 1/"
            f"{collective.SLOW_RATIO:g} of the median): the whole job would run at its pace. Check its NIC, "
            "cable, switch port and link speed (ethtool, ip -s link)"))
    console.print(f"ddp-check: {result.elapsed:.1f} s in all, {view.report.get('seconds', 0):.1f} s of it measuring "
                  "(the rest: connect, preflight, start, import torch)", markup=False, highlight=False)
    return EXIT_SETUP if slow else EXIT_OK


def check_table(statuses, problems, master_port) -> Table:
    by_node: dict[str, list] = {}
    for p in problems:
        by_node.setdefault(p.node, []).append(p)
    table = Table(title=f"ddp-check (master port {master_port or '-'})", title_justify="left")
    for column in ("node", "host", "ok", "torch", "python", "gpus", "interface", "clock skew", "disk free"):
        table.add_column(column, no_wrap=True)
    for s in statuses:
        mine = by_node.get(s.plan.label, [])
        info = s.info
        table.add_row(
            str(s.plan.index), s.plan.label, Text("✗", style="bold red") if mine else Text("✓", style="green"),
            torch_versions(info), info.get("python") or "-", str(info.get("gpus", "-")),
            (s.reach.iface or "-") if s.reach else "-",
            "-" if s.clock_skew is None else f"{s.clock_skew:+.2f} s",
            "-" if "disk_free" not in info else f"{info['disk_free'] / 2**30:.1f} GiB")
    return table


# --- ddp-kill -------------------------------------------------------------------------------

def kill_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ddp-kill",
        description="Stop ddp-up job processes on every node, found by the tags ddp-up put in their environment "
                    "(never by name). Default: jobs launched from this cluster file.")
    p.add_argument("cluster", metavar="CLUSTER.yaml", nargs="?", help="optional with a node option below")
    add_node_sources(p)
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("--job", metavar="ID", help="only this job")
    scope.add_argument("--all", action="store_true", help="every ddp-up job of this user on these nodes")
    p.add_argument("--dry-run", action="store_true", help="list what would be stopped; stop nothing")
    p.add_argument("--purge", action="store_true",
                   help="also remove the records and logs that finished detached jobs keep on the nodes "
                        "(else kept 7 days)")
    return p


def main_kill(argv: list[str] | None = None) -> int:
    args = kill_parser().parse_args(sys.argv[1:] if argv is None else argv)
    console = terminal_console()
    if args.job is not None:
        try:
            check_job_id(args.job, "--job")
        except UsageError as e:
            return _report("ddp-kill", e)
    config = _load_or_report(args, "ddp-kill", forward=False)
    if config is None:
        return EXIT_USAGE

    def match_of(node):
        if args.all:
            return match_for()
        if args.job:
            return match_for(job=args.job)
        return match_for(cluster=config.cluster_id, node=node.rank)

    with signals.recording(), ssh_connections():
        try:
            reports = sweep_nodes(list(config.nodes), match_of, grace=config.stop_grace, dry_run=args.dry_run,
                                  purge=args.purge)
        except Interrupted as e:
            return _interrupted("ddp-kill", e, "before every node answered; run ddp-kill again to confirm")
    console.print(kill_table(reports, args.dry_run))
    for r in reports:
        if r.error:
            console.print(Text("✗ ", style="bold red") + Text(safe_text(f"{r.node.label}: {r.error}")))
    return EXIT_JOB_FAILED if any(r.error or r.left for r in reports) else EXIT_OK


def kill_table(reports: list[SweepReport], dry_run: bool) -> Table:
    table = Table(title="ddp-kill (dry run: nothing stopped)" if dry_run else "ddp-kill", title_justify="left")
    for column in ("node", "host", "jobs", "found", "stopped", "needed SIGKILL", "left", "error"):
        table.add_column(column)
    for r in reports:
        stopped = 0 if dry_run else len(r.found) - len(r.left)
        table.add_row(str(r.node.rank), r.node.label, ", ".join(r.jobs) or "-", str(len(r.found)), str(stopped),
                      str(len(r.killed)), str(len(r.left)), "see below" if r.error else "")
    return table


def _load_or_report(args: argparse.Namespace, prog: str, script_too: bool = False, forward: bool = True):
    """The validated cluster (file and/or node option), or None after printing its one error."""
    try:
        source = node_source(args)
        if script_too:
            args.cluster, args.script = cluster_and_script(args.cluster, args.script, source is not None)
        if args.cluster is None and source is None:
            raise UsageError(f"{prog} needs CLUSTER.yaml, or the nodes from --hostfile, -H or --slurm")
        return load_cluster(args.cluster, source, forward=forward)
    except DdpUpError as e:
        _report(prog, e)
        return None


def _report(prog: str, e: DdpUpError, secrets: frozenset[str] = frozenset()) -> int:
    """The error's one message on stderr (secrets masked, control characters dropped); its exit status."""
    text = safe_text(mask_secrets(e.render(), secrets))
    Console(stderr=True, highlight=False, soft_wrap=True).print(f"[bold red]{prog}:[/] {_escape(text)}")
    return e.exit_code


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


if __name__ == "__main__":  # pragma: no cover
    from .entry import up

    up()
