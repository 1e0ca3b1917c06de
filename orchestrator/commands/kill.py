"""ddp-kill: the job's processes on every node, found by their tags (never by name), stopped."""

from __future__ import annotations

import argparse
import json
import signal
import sys

from rich.table import Table
from rich.text import Text

from ..clean import outside
from ..config.cluster import JOB_SIGNALS, job_signal
from ..errors import EXIT_JOB_FAILED, EXIT_OK, EXIT_USAGE, Interrupted, UsageError
from ..plan.launch import check_job_id
from ..remote import signals
from ..remote.cleanup import SweepReport, match_for, sweep_nodes
from .common import EVERY_JOB, Parser, add_node_sources, interrupted, load_or_report, report, ssh_connections, table_console


def kill_parser() -> argparse.ArgumentParser:
    p = Parser(
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
    p.add_argument("--signal", metavar="NAME", type=signal_name,
                   help="instead of stopping: send this signal (USR1, USR2, HUP, INT) to every rank of the job(s), "
                        "which go on (a script that checkpoints on SIGUSR1, say)")
    p.add_argument("--json", action="store_true", help="one JSON object per node, for scripts")
    p.add_argument("--runs-dir", default="runs", metavar="DIR",
                   help="where ddp-up kept its runs: a detached job's record of its nodes (`nodes_command:`) is read there")
    return p


def signal_name(text: str) -> str:
    """--signal's value as a signal's full name (USR1, usr1 and SIGUSR1 alike)."""
    name = job_signal(text)
    if name is None:
        shown = sorted(JOB_SIGNALS, key=lambda n: (getattr(signal, n) not in signals.PASSED_ON, n))  # never a stop first
        raise argparse.ArgumentTypeError(f"{text[:40]!r}: one of {', '.join(n[3:] for n in shown)}")
    return name


def main_kill(argv: list[str] | None = None) -> int:
    args = kill_parser().parse_args(sys.argv[1:] if argv is None else argv)
    console = table_console()
    if args.job is not None:
        try:
            check_job_id(args.job, "--job")
        except UsageError as e:
            return report("ddp-kill", e)
    config = load_or_report(args, "ddp-kill", forward=False, jobs=[args.job] if args.job else EVERY_JOB)
    if config is None:
        return EXIT_USAGE

    def match_of(node):
        # a signal goes to this node's part only: a host running two nodes' ranks (transport: local,
        # or nodes that share one) must not give each rank the signal twice
        mine = node.rank if args.signal else None
        if args.all:
            return match_for(node=mine)
        if args.job:
            return match_for(job=args.job, node=mine)
        return match_for(cluster=config.cluster_id, node=node.rank)

    with signals.recording(), ssh_connections():
        try:
            reports = sweep_nodes(list(config.nodes), match_of, grace=config.stop_grace, dry_run=args.dry_run,
                                  purge=args.purge, signal=args.signal)
        except Interrupted as e:
            return interrupted("ddp-kill", e, "before every node answered; run ddp-kill again to confirm")
    if args.signal:
        return signal_report(reports, args, console)
    if args.json:
        for r in reports:
            print(json.dumps(kill_record(r, args.dry_run)))
    else:
        console.print(kill_table(reports, args.dry_run))
        for r in reports:
            verb = "would remove" if args.dry_run else "removed"
            if r.removed:
                console.print(outside(f"{r.node.label}: {verb} the state of {', '.join(r.removed)}"))
            if r.containers:
                console.print(outside(f"{r.node.label}: {verb} container(s) {', '.join(r.containers)}"))
    for r in reports:
        if r.error:
            console.print(Text("✗ ", style="bold red") + outside(f"{r.node.label}: {r.error}"))
    return EXIT_JOB_FAILED if any(r.error or r.left for r in reports) else EXIT_OK


def signal_report(reports: list[SweepReport], args: argparse.Namespace, console) -> int:
    """--signal: which ranks got it on each node (--dry-run: would get it); 1 if none did anywhere."""
    for r in reports:
        ranks = r.found if args.dry_run else r.signalled
        if args.json:
            print(json.dumps({"node": r.node.rank, "host": r.node.label, "signal": args.signal,
                              "ranks": [p["pid"] for p in r.found] if args.dry_run else list(r.signalled),
                              "error": r.error, "dry_run": args.dry_run}))
        elif r.error:
            console.print(Text("✗ ", style="bold red") + outside(f"{r.node.label}: {r.error}"))
        else:
            verb = "would send" if args.dry_run else "sent"
            console.print(outside(f"{r.node.label}: {verb} {args.signal} to {len(ranks)} rank(s); nothing stopped"))
    reached = sum(len(r.found if args.dry_run else r.signalled) for r in reports)
    return EXIT_OK if reached and not any(r.error for r in reports) else EXIT_JOB_FAILED


def kill_record(r: SweepReport, dry_run: bool) -> dict:
    """One node's sweep, for scripts (--json)."""
    return {"node": r.node.rank, "host": r.node.label, "jobs": list(r.jobs), "found": len(r.found),
            "stopped": 0 if dry_run else len(r.found) - len(r.left), "killed": len(r.killed), "left": len(r.left),
            "error": r.error, "dry_run": dry_run, "removed": list(r.removed), "containers": list(r.containers)}


def kill_table(reports: list[SweepReport], dry_run: bool) -> Table:
    table = Table(title="ddp-kill (dry run: nothing stopped)" if dry_run else "ddp-kill", title_justify="left")
    for column in ("node", "host", "jobs", "found", "stopped", "needed SIGKILL", "left", "error"):
        table.add_column(column)
    for r in reports:
        stopped = 0 if dry_run else len(r.found) - len(r.left)
        table.add_row(str(r.node.rank), outside(r.node.label), outside(", ".join(r.jobs) or "-"), str(len(r.found)),
                      str(stopped),
                      str(len(r.killed)), str(len(r.left)), "see below" if r.error else "")
    return table
