"""What the command shells share: the node options, the view options, loading the cluster file,
and the one way an error or a signal becomes a message and an exit status."""

from __future__ import annotations

import argparse
import os
import signal
from contextlib import contextmanager

from rich.console import Console
from rich.markup import escape as escape_markup

from ..clusterfile import load_cluster
from ..config import NodeSource
from ..detect import resolve_auto_gpus
from ..errors import DdpUpError, Interrupted, UsageError
from ..hostlists import parse_host_list, parse_hostfile, slurm_nodes
from ..paramiko_ssh import ssh_facts
from ..plan import LaunchPlan, mask_secrets
from ..reading import read_text
from ..sshmaster import CONTROL
from ..views.console import ConsoleView, safe_text, terminal_console
from ..views.dashboard import DashboardView
from ..views.filters import parse_ranks


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


PIPED_WIDTH = 10_000  # a table printed to a pipe or a file: as wide as its rows are


def table_console() -> Console:
    """The console for a command's table: on a terminal, its width; into a pipe or a file, every
    column whole (no job id or state cut at 80 columns for the script that reads it)."""
    console = terminal_console()
    if not console.is_terminal:
        console.width = PIPED_WIDTH
    return console


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


def is_cluster_file(arg: str) -> bool:
    return arg.endswith((".yaml", ".yml"))


def cluster_and_script(first: str | None, second: str | None, has_source: bool) -> tuple[str | None, str | None]:
    """With nodes from elsewhere the cluster file is optional: a lone positional is the script
    unless it names a .yaml/.yml file."""
    if has_source and second is None and first is not None and not is_cluster_file(first):
        return None, first
    return first, second


@contextmanager
def ssh_connections():
    """The run's shared SSH connections (openssh client) end with the command."""
    try:
        yield
    finally:
        CONTROL.close()


def interrupted(prog: str, e: Interrupted, what: str) -> int:
    Console(stderr=True, highlight=False, soft_wrap=True).print(
        f"{prog}: {signal.Signals(e.signum).name} {what}", markup=False)
    return 128 + e.signum


def resolve_nodes(config, console: Console):
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


def load_or_report(args: argparse.Namespace, prog: str, script_too: bool = False, forward: bool = True):
    """The validated cluster (file and/or node option), or None after printing its one error."""
    try:
        source = node_source(args)
        if script_too:
            args.cluster, args.script = cluster_and_script(args.cluster, args.script, source is not None)
        if args.cluster is None and source is None:
            raise UsageError(f"{prog} needs CLUSTER.yaml, or the nodes from --hostfile, -H or --slurm")
        return load_cluster(args.cluster, source, forward=forward)
    except DdpUpError as e:
        report(prog, e)
        return None


def report(prog: str, e: DdpUpError, secrets: frozenset[str] = frozenset()) -> int:
    """The error's one message on stderr (secrets masked, control characters dropped); its exit status."""
    text = safe_text(mask_secrets(e.render(), secrets))
    Console(stderr=True, highlight=False, soft_wrap=True).print(f"[bold red]{prog}:[/] {escape(text)}")
    return e.exit_code


def escape(text: str) -> str:
    """``text`` with rich markup neutralised: shown as it is, never interpreted."""
    return escape_markup(text)
