"""Command-line shells for ddp-up and ddp-kill.

The only layer that turns signals into exceptions and exceptions into exit statuses; the code
below it reports problems as values or DdpUpError subclasses that render themselves.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from rich.console import Console
from rich.table import Table

from . import __version__
from .cleanup import SweepReport, match_for, sweep_nodes
from .config import load_cluster
from .errors import EXIT_INTERNAL, EXIT_JOB_FAILED, EXIT_OK, DdpUpError, Interrupted
from .job import Job
from .plan import LaunchPlan, make_plan, new_job_id
from .views.console import ConsoleView

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


# --- ddp-up ---------------------------------------------------------------------------------

def up_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ddp-up",
        description="Launch a multi-node torchrun job over SSH; every remote process it starts is stopped on exit.",
        epilog="Everything after SCRIPT is passed to the script verbatim. Exit status: 0 ok, 1 job failed, "
               "2 bad config or usage, 3 a node could not be set up (nothing started), 70 internal error, "
               "128+N killed by signal N.")
    p.add_argument("cluster", metavar="CLUSTER.yaml", help="cluster file (see configs/)")
    p.add_argument("script", metavar="SCRIPT", help="training script, resolved in each node's workdir")
    p.add_argument("--dry-run", action="store_true", help="print the command for every node; connect to nothing")
    p.add_argument("--job-id", help="use this job id instead of a generated one")
    p.add_argument("--version", action="version", version=f"ddp-up {__version__}")
    return p


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """Our options and the first two positionals, then the script's arguments untouched."""
    ours, positionals = [], 0
    takes_value = {"--job-id"}
    i = 0
    while i < len(argv) and positionals < 2:
        arg = argv[i]
        ours.append(arg)
        if arg == "--":
            ours.pop()
            ours.extend(argv[i + 1:i + 1 + 2 - positionals])
            i += 1 + 2 - positionals
            break
        if arg in takes_value and i + 1 < len(argv):
            ours.append(argv[i + 1])
            i += 1
        elif not arg.startswith("-") or arg == "-":
            positionals += 1
        i += 1
    return ours, argv[i:]


def main_up(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, script_args = split_argv(argv)
    args = up_parser().parse_args(ours)
    console = Console(highlight=False, soft_wrap=True)
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    try:
        config = load_cluster(args.cluster)
        plan = make_plan(config, args.script, script_args, args.job_id or new_job_id(), os.getcwd())
        if args.dry_run:
            print_dry_run(plan, console)
            return EXIT_OK
        return run_job(plan, ConsoleView(plan, console))
    except DdpUpError as e:
        err.print(f"[bold red]ddp-up:[/] {_escape(e.render())}")
        return e.exit_code
    except Exception:  # noqa: BLE001 - a bug: show it, and say what happened to the job
        err.print_exception()
        err.print("[bold red]ddp-up: internal error[/] (a bug; please report it). Connections were closed, "
                  "so every node stops its job by itself; `ddp-kill CLUSTER.yaml` confirms.")
        return EXIT_INTERNAL


def run_job(plan: LaunchPlan, view: ConsoleView) -> int:
    """Run to completion; first signal = graceful stop of all nodes, second = SIGKILL now."""
    gate = SignalGate()
    job = Job(plan, view)
    view.intro(plan)
    with gate:
        try:
            try:
                result = job.run()
            except Interrupted as e:
                view.notice(f"{signal.Signals(e.signum).name}: stopping all nodes (Ctrl-C again to kill now)")
                try:
                    result = job.stop(e.signum, reason=f"interrupted ({signal.Signals(e.signum).name})")
                except Interrupted:
                    view.notice("killing every job process now")
                    result = job.kill()
        finally:
            gate.hold()  # cleanup below must run to the end
            job.close()
    result.sweeps = job.sweeps
    view.finished(result)
    return result.exit_code


class SignalGate:
    """Turns the first two SIGINT/SIGTERM/SIGHUP into Interrupted; later ones are only noted."""

    def __init__(self) -> None:
        self.count = 0
        self.holding = False
        self.previous: dict[int, object] = {}

    def __enter__(self) -> SignalGate:
        for sig in HANDLED_SIGNALS:
            self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def hold(self) -> None:
        self.holding = True

    def _handle(self, signum: int, _frame) -> None:
        self.count += 1
        if not self.holding and self.count <= 2:
            raise Interrupted(signum)


def print_dry_run(plan: LaunchPlan, console: Console) -> None:
    port = plan.master_port if plan.master_port is not None else "<auto: a free port on the master>"
    console.print(f"# job {plan.job_id}: {len(plan.nodes)} node(s), world size {plan.world_size}, "
                  f"master {plan.master_addr}:{port}", markup=False)
    for node in plan.nodes:
        cfg = node.config
        via = "local" if cfg.transport == "local" else \
            f"ssh {cfg.ssh.user + '@' if cfg.ssh.user else ''}{cfg.host} -p {cfg.ssh.port}"
        ranks = f"{node.ranks.start}-{node.ranks.stop - 1}"
        console.print(f"# node {node.index} {node.label} ({via}), ranks {ranks}", markup=False)
        console.print(plan.shell_line(node, port), markup=False)


# --- ddp-kill -------------------------------------------------------------------------------

def kill_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ddp-kill",
        description="Stop ddp-up job processes on every node, found by the tags ddp-up put in their environment "
                    "(never by name). Default: jobs launched from this cluster file.")
    p.add_argument("cluster", metavar="CLUSTER.yaml")
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("--job", metavar="ID", help="only this job")
    scope.add_argument("--all", action="store_true", help="every ddp-up job of this user on these nodes")
    p.add_argument("--dry-run", action="store_true", help="list what would be stopped; stop nothing")
    return p


def main_kill(argv: list[str] | None = None) -> int:
    args = kill_parser().parse_args(sys.argv[1:] if argv is None else argv)
    console = Console(highlight=False, soft_wrap=True)
    try:
        config = load_cluster(args.cluster)
    except DdpUpError as e:
        Console(stderr=True).print(f"[bold red]ddp-kill:[/] {_escape(e.render())}")
        return e.exit_code

    def match_of(node):
        if args.all:
            return match_for()
        if args.job:
            return match_for(job=args.job)
        return match_for(cluster=config.cluster_id, node=node.rank)

    reports = sweep_nodes(list(config.nodes), match_of, grace=config.stop_grace, dry_run=args.dry_run)
    console.print(kill_table(reports, args.dry_run))
    return EXIT_JOB_FAILED if any(r.error or r.left for r in reports) else EXIT_OK


def kill_table(reports: list[SweepReport], dry_run: bool) -> Table:
    table = Table(title="ddp-kill (dry run: nothing stopped)" if dry_run else "ddp-kill", title_justify="left")
    for column in ("node", "host", "jobs", "found", "stopped", "needed SIGKILL", "left", "error"):
        table.add_column(column)
    for r in reports:
        stopped = 0 if dry_run else len(r.found) - len(r.left)
        table.add_row(str(r.node.rank), r.node.label, ", ".join(r.jobs) or "-", str(len(r.found)), str(stopped),
                      str(len(r.killed)), str(len(r.left)), r.error or "")
    return table


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main_up())
