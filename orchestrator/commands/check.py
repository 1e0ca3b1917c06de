"""ddp-check: every node checked in parallel, nothing started; with --collective, a short real
all_reduce and every node's link."""

from __future__ import annotations

import argparse
import json
import os
import sys

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..clean import outside, safe_text
from ..config.masking import mask_secrets
from ..diagnose import collective
from ..diagnose.preflight import torch_versions
from ..errors import EXIT_JOB_FAILED, EXIT_OK, EXIT_SETUP, EXIT_USAGE, Interrupted, SetupError
from ..job.loop import Job
from ..plan.launch import make_plan, new_job_id
from ..remote import signals
from ..views.terminal import terminal_console
from . import gpus
from .common import (Parser, QuietView, ReportView, add_node_sources, interrupted, load_or_report, report, resolve_nodes, ssh_connections,
                     table_console)


def check_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="ddp-check",
        description="Check every node in parallel without starting anything: SSH login and host key, python, "
                    "torch (same version everywhere), workdir and script, master port, a real TCP connection "
                    "from every node to master addr:port, clock skew, free disk, GPUs.")
    p.add_argument("cluster", metavar="CLUSTER.yaml", nargs="?", help="optional with a node option below")
    p.add_argument("script", metavar="SCRIPT", nargs="?", help="also check it exists on every node")
    p.add_argument("--collective", action="store_true",
                   help="after the checks, run a short real all_reduce across the nodes (NCCL on GPUs, else gloo) "
                        "and time every node's link; nodes far slower than the median are named (exit 3)")
    p.add_argument("--gpus", action="store_true",
                   help="after the checks, measure every GPU of every node at once (matmul TFLOPs, device copy and "
                        "host-to-GPU GB/s) against the median of its model and its data-sheet peak; GPUs far "
                        "slower are named with what nvidia-smi says about them (exit 3)")
    p.add_argument("--json", action="store_true",
                   help="one JSON object per node (with --gpus: per GPU), for scripts (not with --collective)")
    add_node_sources(p)
    return p


def main_check(argv: list[str] | None = None) -> int:
    args = check_parser().parse_args(sys.argv[1:] if argv is None else argv)
    # --json: stdout holds the records alone; the notes on the way go to stderr
    console = Console(stderr=True, highlight=False, soft_wrap=True) if args.json else terminal_console()
    config = load_or_report(args, "ddp-check", script_too=True)
    if config is None:
        return EXIT_USAGE
    with signals.recording() as inbox, ssh_connections():
        try:
            config = resolve_nodes(config, console)
        except SetupError as e:
            return report("ddp-check", e, config.secret_values)
        except Interrupted as e:
            return interrupted("ddp-check", e, "while checking; nothing was started")
        if args.collective:
            return check_collective(config, console, inbox)
        if args.gpus:
            return gpus.check_gpus(config, console, inbox, args.json)
        plan = make_plan(config, args.script or "", [], new_job_id(), os.getcwd())
        job = Job(plan, QuietView(console), inbox=inbox)
        try:
            problems = job.check()
        finally:
            job.close()
        if job.interrupted:
            return interrupted("ddp-check", Interrupted(job.interrupted), "while checking; nothing was started")
    if args.json:
        for record in check_records(job.status, problems, config.secret_values):
            print(json.dumps(record))
        return EXIT_SETUP if problems else EXIT_OK
    console = table_console()  # into a pipe or a file: every column whole
    console.print(check_table(job.status, problems, job.master_port))
    for p in problems:
        console.print(Text("✗ ", style="bold red") + Text(safe_text(mask_secrets(p.render(), config.secret_values))))
    return EXIT_SETUP if problems else EXIT_OK


class _ProbeView(ReportView):
    """Keeps the collective probe's report (rank 0's)."""

    def __init__(self, console: Console):
        super().__init__(console)
        self.report: dict | None = None

    def take(self, node, line) -> bool:
        report = collective.read_report(line.text) if line.rank == 0 else None
        if report is not None:
            self.report = report
        return report is not None


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
        return report("ddp-check", e, config.secret_values)
    finally:
        job.close()
    if job.interrupted:
        return interrupted("ddp-check", Interrupted(job.interrupted), "while measuring; every node stopped its part")
    if view.report is None:
        cause = result.root_cause
        console.print(outside(f"ddp-check: the collective probe failed: {cause.render() if cause else 'no report'}",
                              style="bold red"))
        node = cause.node if cause else 0
        for text in view.last.get(node, []):
            console.print(Text(f"  {safe_text(plan.mask(text))}"))
        return EXIT_JOB_FAILED
    console.print(collective.render(view.report, [n.label for n in plan.nodes]))
    slow = collective.slow_nodes(collective.node_links(view.report))
    for node in slow:
        console.print(Text("✗ ", style="bold red") + outside(
            f"{plan.nodes[node].label}: its link is far slower than the other nodes' (under 1/"
            f"{collective.SLOW_RATIO:g} of the median): the whole job would run at its pace. Check its NIC, "
            "cable, switch port and link speed (ethtool, ip -s link)"))
    for late in collective.lateness(view.report):
        if late.straggler:  # a warning: a node busy with something else now may be fine at the job's start
            console.print(Text("! ", style="bold yellow") + outside(
                f"{plan.nodes[late.node].label}: a straggler at the probe's collectives ({late.text()}): every "
                "collective of the job would wait for it. Look for other load on it (top, nvidia-smi) or a slower CPU"))
    console.print(f"ddp-check: {result.elapsed:.1f} s in all, {view.report.get('seconds', 0):.1f} s of it measuring "
                  f"(the rest: connect, preflight, {collective.start_text(view.report)})", markup=False, highlight=False)
    return EXIT_SETUP if slow else EXIT_OK


def check_records(statuses, problems, secrets) -> list[dict]:
    """--json: one object a node, with check_table's columns as values and its problems in words."""
    return [{"node": s.plan.index, "host": s.plan.label, "ok": not any(p.node == s.plan.label for p in problems),
             "torch": s.info.get("torch"), "python": s.info.get("python"), "gpus": s.info.get("gpus"),
             "interface": s.reach.iface if s.reach else None, "clock_skew": s.clock_skew,
             "disk_free": s.info.get("disk_free"),
             "problems": [mask_secrets(p.render(), secrets) for p in problems if p.node == s.plan.label]}
            for s in statuses]


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
            str(s.plan.index), outside(s.plan.label), Text("✗", style="bold red") if mine else Text("✓", style="green"),
            outside(torch_versions(info)), outside(info.get("python") or "-"), outside(info.get("gpus", "-")),
            outside((s.reach.iface or "-") if s.reach else "-"),
            "-" if s.clock_skew is None else f"{s.clock_skew:+.2f} s",
            "-" if "disk_free" not in info else f"{info['disk_free'] / 2**30:.1f} GiB")
    return table
