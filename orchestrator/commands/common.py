"""What the command shells share: the node options, the view options, loading the cluster file,
and the one way an error or a signal becomes a message and an exit status."""

from __future__ import annotations

import argparse
import difflib
import os
import signal
import sys
from contextlib import contextmanager
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape as escape_markup

from ..clean import safe_lines
from ..config.cluster import NodeSource
from ..config.clusterfile import Recorded, load_cluster
from ..config.hostlists import parse_host_list, parse_hostfile, slurm_nodes
from ..config.masking import mask_secrets
from ..config.reading import read_text
from ..config.values import parse_duration
from ..errors import DdpUpError, Interrupted, UsageError
from ..remote.sshmaster import CONTROL
from ..run.record import detached_here, recorded_nodes
from ..version import __version__
from ..views.terminal import terminal_console

if TYPE_CHECKING:  # the views and the planner are imported where used: ddp-fetch, ddp-ls and ddp-kill need neither
    from ..plan.launch import LaunchPlan
    from ..views.console import ConsoleView

# What each command's exit status means, at the end of its --help (the README lists them too).
EXITS = {
    "ddp-up": "0 ok, 1 job failed, 2 bad config or usage, 3 a node could not be set up (nothing started), "
              "70 internal error, 128+N killed by signal N",
    "ddp-kill": "0 every node answered and nothing of the job(s) is left, 1 a node could not be reached or a "
                "process outlived SIGKILL, 2 bad cluster file or usage, 128+N killed by signal N",
    "ddp-check": "0 every node is ready, 1 --collective or --gpus could not run, 2 bad cluster file or usage, 3 a "
                 "node is not ready (or, with --collective, a link far slower than the others; with --gpus, a GPU "
                 "far slower than its peers or not measured), 128+N killed by signal N",
    "ddp-ls": "0 listed, 2 bad cluster file or usage, 3 a node could not be asked (the others' jobs are "
              "listed), 128+N killed by signal N",
    "ddp-attach": "the job's own status once it has ended (0 ok, 1 failed), 0 when left while it runs, 2 bad "
                  "cluster file or usage, 3 no such job or a node could not be reached, 128+N killed by signal N",
    "ddp-fetch": "0 every node's copy is here, 2 bad cluster file or usage, 3 a node could not be read from "
                 "or its copy written (the others' copies are made), 128+N killed by signal N",
    "ddp-report": "0 written, 1 it could not be written, 2 bad cluster file or usage, 3 no such run or job (or a "
                  "node could not be reached), 128+N killed by signal N",
    "ddp-logs": "0 printed, 2 bad cluster file or usage, 3 no such job or a node could not be reached, 128+N "
                "killed by signal N",
}


class Parser(argparse.ArgumentParser):
    """argparse's parser, naming the near option for an unknown one (``--dryrun``: did you mean
    ``--dry-run``?), ending --help with the command's exit statuses (EXITS), and with --version
    on every command."""

    def __init__(self, prog: str, description: str = "", epilog: str = "", **kwargs):
        epilog = "\n".join(part for part in (epilog, f"Exit status: {EXITS[prog]}.") if part)
        super().__init__(prog=prog, description=fill(description), epilog=fill(epilog),
                         formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)
        self.add_argument("--version", action="version", version=f"{prog} {__version__}")
        self.add_argument("--print-completion", choices=("bash", "zsh"), action=Completion,
                          help=f"print a completion script, e.g. `{prog} --print-completion bash > "
                               f"~/.local/share/bash-completion/completions/{prog}`")

    def error(self, message: str):  # type: ignore[override]
        words = message.partition("unrecognized arguments: ")[2].split()
        options = [o for o in self._option_string_actions if o.startswith("--")]
        for word in (w for w in words if w.startswith("-")):
            near = difflib.get_close_matches(word.split("=")[0], options, n=1, cutoff=0.6)
            if near:
                message += f" (did you mean {near[0]}?)"
                break
        super().error(message)


class Completion(argparse.Action):
    """--print-completion SHELL: shtab writes the script from this very parser, so completion never
    drifts from the options (imported only then: every command's start stays as quick)."""

    def __call__(self, parser, namespace, values, option_string=None):
        import shtab

        print(shtab.complete(parser, shell=values))
        parser.exit(0)


def fill(text: str) -> str:
    """Paragraphs (one a line) wrapped for --help, which keeps the line breaks of an epilog as given."""
    import textwrap

    return "\n\n".join(textwrap.fill(par, 100) for par in text.split("\n"))


def duration_arg(text: str) -> float:
    """A command-line duration: seconds, or with a unit (90s, 5m, 12h, 7d), as the cluster file takes."""
    try:
        return float(text)  # nan and inf too: the command checks the range, and says so
    except ValueError:
        seconds = parse_duration(text)
    if seconds is None:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (seconds, or 90s, 5m, 12h, 7d)")
    return seconds


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


def make_view(plan: LaunchPlan, console: Console, args: argparse.Namespace, plain=None,
              prog: str = "ddp-up") -> ConsoleView:
    """The view the view options ask for: the dashboard on a terminal (or when forced), else
    ``plain`` lines (ConsoleView unless given); its notices are ``prog``'s."""
    from ..views.console import ConsoleView
    from ..views.dashboard import DashboardView
    from ..views.filters import parse_ranks

    ranks = parse_ranks(args.ranks, plan.world_size) if args.ranks else None
    dashboard = (interactive(console) or jupyter_live(console)) if args.dashboard is None else args.dashboard
    if dashboard and not console.is_terminal and not console.is_jupyter:
        console = terminal_console(force_terminal=True)
    return (DashboardView if dashboard else plain or ConsoleView)(plan, console, ranks=ranks, collapse=args.collapse,
                                                                 prog=prog)


def interactive(console: Console) -> bool:
    """Whether a live dashboard goes there: a terminal, really (FORCE_COLOR makes Rich color a pipe,
    as it should, but a pipe gets lines, not a redrawn screen)."""
    return console.is_terminal and (os.environ.get("FORCE_COLOR") is None or sys.stdout.isatty())


def jupyter_live(console: Console) -> bool:
    """Whether a notebook can redraw the dashboard in place: rich draws a live display there in an
    ipywidgets Output (without ipywidgets, the lines alone, and the bars every 10 s)."""
    if not console.is_jupyter:
        return False
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


PIPED_WIDTH = 10_000  # a table printed to a pipe or a file: as wide as its rows are


class QuietView:
    """A job's view that shows a table at the end (ddp-check's), not the nodes' chatter: only
    ddp-up's own notices, under the command's name."""

    def __init__(self, console: Console, prog: str = "ddp-check"):
        self.console, self.prog = console, prog

    def lines(self, node, lines) -> None:
        pass

    def bars(self, node, bars, at=None) -> None:
        pass

    def gpus(self, node, gpus, at=None) -> None:
        pass

    def late(self, figures) -> None:
        pass

    def event(self, kind, text, **fields) -> None:
        pass

    def node_state(self, status) -> None:
        pass

    def tick(self, snapshot) -> None:
        pass

    def notice(self, text: str) -> None:
        self.console.print(f"{self.prog} {text}", markup=False)


class ReportView(QuietView):
    """ddp-check's probes (the collective's, the GPUs'): the report lines ``take`` keeps, and each
    node's last other lines, for when a probe failed before its report."""

    def __init__(self, console: Console, prog: str = "ddp-check"):
        super().__init__(console, prog)
        self.last: dict[int, list[str]] = {}

    def lines(self, node, lines) -> None:
        for line in lines:
            if not self.take(node, line):
                self.last[node.index] = (self.last.get(node.index, []) + [line.text])[-8:]

    def take(self, node, line) -> bool:
        """Whether ``line`` was a report, kept."""
        return False


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
    from ..remote.detect import resolve_auto_gpus
    from ..remote.paramiko_ssh import ssh_facts

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


EVERY_JOB = "every job"  # load_or_report's jobs: every detached job started from here from that file


def load_or_report(args: argparse.Namespace, prog: str, script_too: bool = False, forward: bool = True,
                   jobs: list[str] | str | None = None):
    """The validated cluster (file and/or node option), or None after printing its one error.
    ``jobs``: the detached jobs the command is about (or EVERY_JOB), whose own record of their
    nodes stands for what `nodes_command:` lists now (jobs_record)."""
    try:
        source = node_source(args)
        if script_too:
            args.cluster, args.script = cluster_and_script(args.cluster, args.script, source is not None)
        if args.cluster is None and source is None:
            raise UsageError("which nodes? name a cluster file (CLUSTER.yaml), or give them with "
                             "--hostfile FILE, -H HOST:N,... or --slurm")
        return load_cluster(args.cluster, source, forward=forward, recorded=jobs_record(args, prog, jobs))
    except DdpUpError as e:
        report(prog, e)
        return None


def jobs_record(args: argparse.Namespace, prog: str, jobs: list[str] | str | None) -> Recorded | None:
    """The nodes that ``jobs`` recorded in the runs directory at their launch (a `nodes_command:`
    file's detached jobs): a command about one job reaches its nodes alone, whatever the program
    lists now or whether it runs at all; one about every job (EVERY_JOB) asks the program too, for
    nodes that are new since, and goes on without it if it fails. None: no record here."""
    if args.cluster is None or jobs is None or not is_cluster_file(args.cluster):
        return None
    runs_dir = getattr(args, "runs_dir", "runs")
    ask = jobs == EVERY_JOB
    if ask:
        jobs = sorted(detached_here(runs_dir).get(os.path.abspath(args.cluster), ()))
    nodes = recorded_nodes(runs_dir, jobs)
    if nodes is None:
        return None
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    return Recorded(nodes, ask, note=lambda text: err.print(f"[bold yellow]{prog}:[/] {escape(safe_lines(text))}"))


def report(prog: str, e: DdpUpError, secrets: frozenset[str] = frozenset()) -> int:
    """The error's one message on stderr (secrets masked, control characters dropped, its own
    line breaks kept); its exit status."""
    text = safe_lines(mask_secrets(e.render(), secrets))
    Console(stderr=True, highlight=False, soft_wrap=True).print(f"[bold red]{prog}:[/] {escape(text)}")
    return e.exit_code


def escape(text: str) -> str:
    """``text`` with rich markup neutralised: shown as it is, never interpreted."""
    return escape_markup(text)
