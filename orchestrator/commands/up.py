"""ddp-up: the cluster file and the script to a plan, then the run (runloop.py) with its views.

The only layer that turns exceptions into exit statuses; the code below it reports problems as
values or DdpUpError subclasses that render themselves. Signals are recorded by signals.py; the
shell reads the inbox between start-up steps (and the parallel calls while they wait), the job
loop at every turn.
"""

from __future__ import annotations

import argparse
import io
import os
import shlex
import sys
from dataclasses import replace
from functools import partial

from rich.console import Console

from ..config.cluster import NodeSource, SyncConfig
from ..config.clusterfile import load_cluster, relisted
from ..config.validate import LONGEST, MOST_RESTARTS
from ..errors import EXIT_INTERNAL, EXIT_OK, DdpUpError, Interrupted, UsageError
from ..node.probes.facts import IFNAME_VARS
from ..plan.launch import LaunchPlan, check_job_id, make_plan, new_job_id, warm_refused
from ..plan.sbatch import SBATCH_SCRIPT, split_sbatch, submit
from ..remote import signals
from ..remote.detect import Answering
from ..remote.fetch import fetch_outputs
from ..remote.parallel import interruptible
from ..remote.sync import Tree, human_bytes, scan, sync_all, targets
from ..run.attempts import Restarts, recovery_limit
from ..run.notifier import Notifier
from ..run.record import RecordTaking, write_nodes
from ..run.runloop import Caller, run_job
from ..views.terminal import terminal_console
from ..views.logfiles import RunLogs
from ..views.transfer import transfer_progress
from . import gpus
from .common import (NODE_SOURCE_FLAGS, Parser, add_node_sources, add_view_options, cluster_and_script, duration_arg,
                     interrupted, is_cluster_file, make_view, node_source, report, resolve_nodes, ssh_connections)


class PrintSchema(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        from ..config.schema import schema_text

        sys.stdout.write(schema_text())
        parser.exit(0)


def up_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="ddp-up",
        usage="ddp-up [options] CLUSTER.yaml SCRIPT [SCRIPT ARGS...]\n"
              "       ddp-up [options] (--hostfile FILE | -H HOST:N,... | --slurm) [CLUSTER.yaml] SCRIPT [ARGS...]\n"
              "       ddp-up --sbatch [SBATCH OPTIONS] [--] CLUSTER.yaml SCRIPT [ARGS...]   (a batch job running "
              "--slurm)",
        description="Launch a multi-node torchrun job over SSH; every remote process it starts is stopped on exit.",
        epilog="Everything after SCRIPT is passed to the script verbatim.")
    p.add_argument("cluster", metavar="CLUSTER.yaml", help="cluster file (see configs/); with a node "
                   "option below, optional and used for its other settings")
    p.add_argument("script", metavar="SCRIPT", nargs="?", help="training script, resolved in each node's workdir")
    add_node_sources(p)
    p.add_argument("--schema", nargs=0, action=PrintSchema,
                   help="print the cluster file's JSON Schema (for an editor: completion and checks of cluster.yaml)")
    p.add_argument("--dry-run", action="store_true", help="print the command for every node; connect to nothing")
    p.add_argument("--sbatch", metavar="SBATCH OPTIONS", nargs="?",  # read before argparse (sbatch.split_sbatch)
                   help="submit the run as a Slurm batch job instead: ddp-up --sbatch -N4 --time=2:00:00 "
                        "CLUSTER.yaml SCRIPT ... (sbatch's options end at -- or the cluster file); it runs "
                        "ddp-up --slurm in the allocation")
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
    p.add_argument("--hang-timeout", type=duration_arg, metavar="SECONDS",
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
    p.add_argument("--allow-unhealthy-gpus", action="store_true",
                   help="start even on GPUs that nvidia-smi reports unhealthy (uncorrected ECC errors, memory "
                        "waiting for a reset, a hardware slowdown; listed as a notice)")
    p.add_argument("--runs-dir", default="runs", metavar="DIR",
                   help="where each job's logs and summary.json go (DIR/<job-id>/; default: runs)")
    return p


# ddp-up's options that take the next word as their value (unless given as --name=VALUE, -HVALUE)
TAKES_VALUE = frozenset({"--job-id", "--ranks", "--runs-dir", "--hang-timeout", "--hostfile", "-H", "--restarts",
                         "--print-completion"})


def names_nodes(arg: str) -> bool:
    """Whether ``arg`` is a node option, in any of its forms: --hostfile FILE, --hostfile=FILE,
    -H LIST, -HLIST, --slurm."""
    return any(arg == flag or arg.startswith(flag + "=") for flag in NODE_SOURCE_FLAGS) or (
        arg.startswith("-H") and not arg.startswith("--"))


def options_end(argv: list[str]) -> int:
    """Where ddp-up's own leading options end: the index of the first word that is neither one of
    them nor an option's value (the cluster file, or the script). What comes later is not ddp-up's
    to read as an option of its own: `--sbatch` after the script is the script's."""
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] not in ("-", "--"):
        i += 2 if argv[i] in TAKES_VALUE else 1
    return min(i, len(argv))


MODULE = "-m"  # the script word that makes the first script argument a module: `ddp-up c.yaml -m pkg.train`


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """Our options and our positionals (cluster file and script: one of them may be left out when
    a node option comes first), then the script's arguments untouched."""
    ours, positionals, wanted = [], 0, 2
    i = 0
    while i < len(argv) and positionals < wanted:
        arg = argv[i]
        ours.append(arg)
        if arg == "--":
            ours.pop()
            ours.extend(argv[i + 1:i + 1 + wanted - positionals])
            i += 1 + wanted - positionals
            break
        no_file = positionals == 0 and any(names_nodes(a) for a in ours[:-1])  # -H a:8 -m pkg.train: no cluster file
        if arg == MODULE and (positionals == wanted - 1 or no_file):  # `-m pkg.train ARGS`: the script is a module,
            ours[-1:] = ["--", MODULE]  # named by its first argument (python -m's and torchrun -m's form)
            i += 1
            break
        if arg in TAKES_VALUE and i + 1 < len(argv):
            ours.append(argv[i + 1])
            i += 1
        elif not arg.startswith("-") or arg == "-":
            positionals += 1
            if positionals == 1 and any(names_nodes(a) for a in ours) and not is_cluster_file(arg):
                wanted = 1  # no cluster file: this is the script
        i += 1
    return ours, argv[i:]


def main_up(argv: list[str] | None = None, caller: Caller = Caller()) -> int:
    """ddp-up's run; from the Python API, with what its caller adds (runloop.Caller: a function
    to run, with ``-m`` and its module as the script; where the result and the lines go)."""
    with signals.recording() as inbox, ssh_connections():
        return _up(sys.argv[1:] if argv is None else argv, inbox, caller)


def _up(argv: list[str], inbox: signals.SignalInbox, caller: Caller) -> int:
    try:
        sbatch_options, argv = split_sbatch(argv, options_end(argv))
    except UsageError as e:
        return report("ddp-up", e)
    ours, script_args = split_argv(argv)
    args = up_parser().parse_args(ours)
    args.command = ["ddp-up", *argv]  # as typed, for the run's record (runrecord.py)
    console = terminal_console()
    secrets: frozenset[str] = frozenset()  # known once the cluster file is read; masked in every message
    if sbatch_options is not None:
        return _submit(args, argv, sbatch_options, console)
    try:
        config = load_for_up(args, inbox)
        secrets = config.secret_values
        return launch(args, script_args, resolve_nodes(config, console), console, inbox, caller)
    except DdpUpError as e:
        return report("ddp-up", e, secrets)
    except Interrupted as e:  # before any job existed: the one-shot calls are closed, nothing to stop
        return interrupted("ddp-up", e, "before the job started; nothing was started")
    except Exception:  # noqa: BLE001 - a bug: show it, and say what happened to the job
        err = Console(stderr=True, highlight=False, soft_wrap=True)
        err.print_exception()
        err.print("[bold red]ddp-up: internal error[/] (a bug; please report it). Connections were closed, "
                  "so every node stops its job by itself; `ddp-kill CLUSTER.yaml` confirms.")
        return EXIT_INTERNAL


def load_for_up(args: argparse.Namespace, inbox: signals.SignalInbox):
    """The validated cluster for this launch, with every option checked against it: UsageError or
    ConfigError (exit 2) before anything is reached."""
    if args.job_id is not None:
        check_job_id(args.job_id, "--job-id")  # before anything is read or reached
        check_fresh_run_dir(os.path.join(args.runs_dir, args.job_id))
    source = node_source(args)
    args.cluster, args.script = cluster_and_script(args.cluster, args.script, source is not None)
    if args.script is None and args.cluster is not None and not is_cluster_file(args.cluster):
        raise UsageError(f"{args.cluster} is not a cluster file: ddp-up CLUSTER.yaml {args.cluster} [ARGS...] "
                         "(configs/local.yaml runs on this machine; configs/cluster.example.yaml shows the keys)")
    if args.script is None:
        raise UsageError("missing SCRIPT: ddp-up [options] CLUSTER.yaml SCRIPT [SCRIPT ARGS...]")

    config = load_cluster(args.cluster, source)
    if args.hang_timeout is not None and not 0 < args.hang_timeout <= LONGEST:
        raise UsageError(f"--hang-timeout must be a number of seconds > 0 and at most {LONGEST:.0f} (30 days)")
    inbox.check()
    if args.restarts is not None and not 0 <= args.restarts <= MOST_RESTARTS:
        raise UsageError(f"--restarts must be an integer between 0 and {MOST_RESTARTS}")
    if args.detach and config.spares:
        raise UsageError("--detach: spares need ddp-up to stay (it starts a spare's agent; a detached job's own "
                         "agents restart it only on the nodes they run on): run without --detach, or use "
                         "`min_nodes:` instead of `spares:` (a detached job goes on without a lost node)")
    if args.detach and any(n.transport == "srun" for n in config.nodes):
        raise UsageError("--detach: a job reached through srun ends with its allocation, which ends with "
                         "this command; to run without a terminal, submit it: ddp-up --sbatch [SBATCH OPTIONS] "
                         "CLUSTER.yaml SCRIPT ... (or set `transport: ssh`)")
    return config


def check_fresh_run_dir(path: str) -> None:
    """A --job-id names one run: a runs/JOB that already holds one (its logs, summary.json) would
    get a second run's lines mixed into the first's. A batch job's (--sbatch wrote its script
    there) is its own: Slurm's requeue runs it again there."""
    try:
        held = sorted(os.listdir(path))
    except FileNotFoundError:
        return
    except OSError as e:
        raise UsageError(f"--job-id: cannot read {path} ({e.strerror or e}): choose another --job-id") from None
    if held and SBATCH_SCRIPT not in held:
        raise UsageError(f"--job-id: {path} already holds a run ({', '.join(held[:3])}{', ...' if len(held) > 3 else ''}); "
                         f"a job id names one run: choose another --job-id, or remove {path}")


def launch(args: argparse.Namespace, script_args: list[str], config, console: Console,
           inbox: signals.SignalInbox, caller: Caller) -> int:
    """Plan the first attempt, copy the workdir if asked, and run (or only print, --dry-run)."""
    if args.script == MODULE and not script_args:
        raise UsageError("-m needs a module: ddp-up [options] CLUSTER.yaml -m PACKAGE.MODULE [ARGS...]")
    job_id = args.job_id or new_job_id()
    limit = config.restarts if args.restarts is None else args.restarts
    sync = sync_choice(args.sync, config.sync)
    record = None if args.dry_run else RecordTaking(args.command, args.cluster, sync.src if sync else os.getcwd(),
                                                    config.source_text)  # git runs while the nodes connect
    def planner(cluster, attempt):
        plan = make_plan(cluster, args.script, script_args, job_id, os.getcwd(), hang_timeout=args.hang_timeout,
                         detach=args.detach, allow_busy_gpus=args.allow_busy_gpus,
                         allow_unhealthy_gpus=args.allow_unhealthy_gpus, attempt=attempt, restarts=limit,
                         recoveries=recovery_limit(config, limit), commit=record and record.commit)
        return replace(plan, hooks=caller.call.hooks()) if caller.call else plan  # a function: its runner, its payload

    # detached, its restarts are its supervisor's; a node lost once is asked again at each restart;
    # `nodes_command:` is run again before each attempt (its SSH notes were said at the launch)
    restarts = Restarts.of(config, limit, planner=planner, prober=Answering(),
                           lister=(lambda c: resolve_nodes(relisted(c), Console(file=io.StringIO())))
                           if config.nodes_command else None)
    plan = restarts.plan(restarts.cluster(), 0)
    if args.dry_run:
        print_dry_run(plan, console, interruptible(lambda: scan(sync, skip=[args.runs_dir])) if sync else None,
                      spares=[n.label for n in restarts.roster.spares])
        return EXIT_OK
    if sync:
        copy_workdirs(plan, sync, args.runs_dir, config.path, console)
    stopped = gpus.gate(restarts.cluster(), console, inbox, args.allow_unhealthy_gpus) \
        if config.measure_gpus else None
    if stopped is not None:
        return stopped
    view = view_for(config, plan, console, args)
    inbox.check()
    logs = RunLogs(plan, args.runs_dir, warn=view.notice)
    logs.record(record)
    if args.detach and config.nodes_command:
        keep_node_list(config, logs.dir, view.notice)
    code = run_planned(plan, view, logs, args, inbox, restarts, caller)
    if config.fetch and not args.detach and code < 128:  # a signal: the user wants out, not a copy
        try:
            fetch_outputs(list(restarts.roster.cluster(config).nodes), config.fetch, logs.dir, view.notice)
        except Interrupted as e:  # the job is over; its copy stops, and says what it kept
            return interrupted("ddp-up", e, f"while fetching {', '.join(config.fetch)} (the job had ended with exit "
                                            f"status {code}); what arrived whole is kept, no partial file is left")
    return code


def keep_node_list(config, where: str, notice) -> None:
    """A detached job's nodes as `nodes_command:` listed them: what later commands for the job
    reach (run/record.write_nodes)."""
    try:
        write_nodes(where, config.nodes)
    except OSError as e:
        notice(f"cannot keep the job's node list in {where} ({e.strerror or e}): later commands for it run "
               "`nodes_command:` again")


def view_for(config, plan: LaunchPlan, console: Console, args: argparse.Namespace):
    """The job's view, and the first thing it says: where `warm: true` cannot apply."""
    view = make_view(plan, console, args)
    cold = warm_refused(config, plan)
    if cold:
        view.notice(cold)
    return view


def run_planned(plan: LaunchPlan, view, logs: RunLogs, args: argparse.Namespace, inbox: signals.SignalInbox,
                restarts: Restarts, caller: Caller) -> int:
    """The job, run: a notifier told of a job that never started, and this job's own kept
    interpreters (warm restarts) ended with it, their processes here waited for."""
    notifier = Notifier(plan.notify, plan.job_id, plan.secrets, view.notice) if plan.notify else None
    across = kept_across_attempts(caller, plan, restarts)
    try:
        return run_job(plan, view, logs, preflight=args.preflight, inbox=inbox,
                       cluster_arg=shlex.join(ours_for_attach(args)),
                       restarts=None if args.detach else restarts, notifier=notifier,
                       caller=across)
    except Exception as e:  # a node not ready (exit 3), a signal before the start, a bug (70): said, then raised
        if notifier is not None:
            notifier.unstarted(e)
        raise
    finally:
        if across.kept is not caller.kept:  # this job's own, not a Python session's
            across.kept.close()


def kept_across_attempts(caller: Caller, plan: LaunchPlan, restarts: Restarts) -> Caller:
    """Warm start with restarts: each node's warm interpreter is kept from one attempt to the next
    (run/kept.py), so that a restart forks from one that imported before the failure. They end
    with the job (main_up closes them, and waits for their processes here)."""
    if caller.kept or not plan.warm or plan.detach or not restarts.any:
        return caller
    from ..run.kept import Kept

    kept, spares = Kept(), restarts.roster.spares
    if spares:  # a spare keeps one ready too, for the attempt it joins
        first = restarts.cluster()
        kept.ahead(restarts.plan(replace(first, nodes=tuple(replace(n, rank=i) for i, n in enumerate(spares))), 0))
    return replace(caller, kept=kept)


def _submit(args: argparse.Namespace, argv: list[str], sbatch_options: list[str], console: Console) -> int:
    """--sbatch: a batch job that runs this very command with --slurm in its allocation."""
    try:
        if args.job_id is not None:
            check_job_id(args.job_id, "--job-id")  # it names the run's directory, here and in the batch job
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
        slurm_job, script = submit(sbatch_options, rest, job_id, args.runs_dir, batch_secrets(args.cluster))
    except DdpUpError as e:
        return report("ddp-up", e)
    console.print(f"ddp-up: submitted Slurm job {slurm_job} ({script}); it runs ddp-up job {job_id} with --slurm. "
                  f"Run logs: {os.path.join(args.runs_dir, job_id)}/; ddp-up's own output: sbatch's output file "
                  f"(slurm-{slurm_job}.out unless --output says otherwise). Stop it: scancel {slurm_job}",
                  markup=False, highlight=False)
    return EXIT_OK


def batch_secrets(cluster: str | None) -> frozenset[str]:
    """The secret values of a settings file for --sbatch, read as the batch job's --slurm will
    (one stand-in node: the allocation's are not known here)."""
    if cluster is None:
        return frozenset()
    stand_in = NodeSource("--sbatch", "", [{"host": "allocation", "gpus": 1}], transport="srun")
    return load_cluster(cluster, stand_in).secret_values


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
    if plan.warms:
        imports = ", ".join(("torch", *plan.preload))
        console.print(f"# warm start: each rank is forked from an interpreter that imported {imports}, and runs as "
                      "the line below would run it (with warm: false, that line runs as it is)", markup=False)
    for node in plan.nodes:
        cfg = node.config
        via = "local" if cfg.transport == "local" else f"srun -w {cfg.host}" if cfg.transport == "srun" else \
            f"ssh {cfg.ssh.user + '@' if cfg.ssh.user else ''}{cfg.host}" + (f" -p {cfg.ssh.port}" if cfg.ssh.port else "")
        ranks = f"{node.ranks.start}-{node.ranks.stop - 1}"
        console.print(f"# node {node.index} {node.label} ({via}), ranks {ranks}", markup=False)
        console.print(plan.shell_line(node, port), markup=False)
    if spares:
        console.print(f"# spares, idle until a node is out: {', '.join(spares)}", markup=False)
