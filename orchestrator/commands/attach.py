"""Detached jobs, from the controller's side: ddp-attach, ddp-logs and ddp-ls (the replay itself
is follow.py's; the job's own agents decide everything, so nothing here is ever sent to it)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time
from contextlib import nullcontext

from rich.table import Table
from rich.text import Text

from ..clean import outside
from ..errors import EXIT_OK, EXIT_USAGE, DdpUpError, Interrupted, NoSuchJob, UsageError
from ..node.protocol import policy, wire
from ..node.supervise.members import RESHAPES
from ..plan.launch import LaunchPlan, check_job_id
from ..remote import signals
from ..remote.oneshot import call_agent
from ..remote.parallel import on_each
from ..run.follow import follow_attempts, follow_plan
from ..run.runloop import report_notice
from ..run.record import detached_here
from ..views.console import ConsoleView
from ..views.terminal import terminal_console
from ..views.fanout import Fanout
from ..views.logfiles import RunLogs
from ..views.report import REPORT
from ..views.metricsfile import MetricsFile
from ..views.timeline import Timeline
from .common import (EVERY_JOB, Parser, add_node_sources, add_view_options, interrupted, is_cluster_file,
                     load_or_report, make_view, report, ssh_connections, table_console)

LIST_LIMIT = 30.0  # seconds beyond the connect timeout for a node to list its jobs


def add_tail(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tail", type=int, metavar="N",
                   help="start from the last N lines of each rank, not the first (the run logs are then left as "
                        "they are)")


def _parser(prog: str, description: str) -> argparse.ArgumentParser:
    p = Parser(prog=prog, description=description)
    p.add_argument("cluster", metavar="CLUSTER.yaml", nargs="?", help="the cluster file the job was started with")
    p.add_argument("job", metavar="JOB", nargs="?", help="the job id (ddp-ls lists them)")
    add_node_sources(p)
    return p


def _job_id(args: argparse.Namespace, prog: str) -> str:
    """The job id argument (after the cluster file, which a node option makes optional)."""
    if args.job is None and args.cluster is not None and not is_cluster_file(args.cluster):
        args.cluster, args.job = None, args.cluster  # `-H a:1 JOB`: no cluster file
    if args.job is None:
        raise UsageError(f"missing JOB: {prog} CLUSTER.yaml JOB (ddp-ls CLUSTER.yaml lists the jobs)")
    check_job_id(args.job, "JOB")
    return args.job


# --- ddp-attach -----------------------------------------------------------------------------

def attach_parser() -> argparse.ArgumentParser:
    p = _parser("ddp-attach", "Watch a detached job as a live run shows it, from its first line, then live. "
                              "Ctrl-C detaches and leaves the job running. Exit status: the job's (0 ok, 1 failed "
                              "or stopped) once it has ended, 2 usage, 3 no such job, 130 detached by Ctrl-C.")
    add_view_options(p)
    p.add_argument("--runs-dir", default="runs", metavar="DIR", help="where the job's logs are written (DIR/<job>/)")
    add_tail(p)
    return p


def main_attach(argv: list[str] | None = None) -> int:
    args = attach_parser().parse_args(sys.argv[1:] if argv is None else argv)
    return _follow("ddp-attach", args, follow=True, show_end=True, page=True)


# --- ddp-logs -------------------------------------------------------------------------------

def logs_parser() -> argparse.ArgumentParser:
    p = _parser("ddp-logs", "Print a detached job's lines from the logs its nodes keep: every line of every rank "
                            "once, in time order across nodes (by their clocks). Exit status: 0, 2 usage, 3 no such job on some node.")
    p.add_argument("--ranks", metavar="LIST", help="only these ranks' lines, e.g. 0,3-5")
    p.add_argument("-f", "--follow", action="store_true", help="go on printing new lines until the job ends")
    p.add_argument("--runs-dir", default="runs", metavar="DIR", help="where the job's logs are written (DIR/<job>/)")
    add_tail(p)
    return p


def main_logs(argv: list[str] | None = None) -> int:
    args = logs_parser().parse_args(sys.argv[1:] if argv is None else argv)
    args.dashboard, args.collapse = False, False  # the lines alone
    return _follow("ddp-logs", args, follow=args.follow, show_end=False)


def _follow(prog: str, args: argparse.Namespace, follow: bool, show_end: bool, page: bool = False,
            plain: type | None = None) -> int:
    """Replay the job's journals (follow_attempts) into the views and the run logs; ``page``: its
    timeline too, and its report (ddp-attach's, ddp-report's)."""
    console = terminal_console()
    try:
        job_id = _job_id(args, prog)
    except DdpUpError as e:
        return report(prog, e)
    config = load_or_report(args, prog, forward=False, jobs=[job_id])
    if config is None:
        return EXIT_USAGE
    with signals.recording() as inbox, ssh_connections():
        # A reader whose stdout goes (`ddp-logs ... | head`) ends there, quietly, as a reader in a
        # pipe does (status 141, SIGPIPE's); the job is not its business.
        console.file.warn = lambda text: inbox.post(signal.SIGPIPE)
        try:
            if args.tail is not None and args.tail < 0:
                raise UsageError(f"--tail {args.tail}: a number of lines, 0 or more")
            found, master, script = job_anywhere(list(config.nodes), job_id)
            if not found:
                raise NoSuchJob(job_id, [n.label for n in config.nodes], args.cluster or "CLUSTER.yaml")
            plan = follow_plan(config, job_id, master, script)
            view = make_view(plan, console, args, plain=plain or (ConsoleView if show_end else LinesView), prog=prog)
        except DdpUpError as e:
            return report(prog, e, config.secret_values)
        except Interrupted as e:
            return interrupted(prog, e, "before every node answered")
        # The journals from their start rewrite the run logs whole; a tail would cut them.
        logs = RunLogs(plan, args.runs_dir, warn=view.notice, fresh=True) if args.tail is None else NoLogs()
        timeline = Timeline(logs.dir, plan, replay=True) if page and args.tail is None and config.report else None
        metrics = MetricsFile(logs.dir, plan) if timeline is not None and plan.metrics is not None else None
        with view, logs, timeline or nullcontext(), metrics or nullcontext():  # the job's metrics so far, its page's
            job, records = follow_attempts(plan, Fanout(view, logs, *(v for v in (timeline, metrics) if v)), follow,
                                           args.tail, inbox, shown=view.ranks, timeline=timeline, metrics=metrics)
        if job.interrupted:
            return 128 + job.interrupted
        console.file.flush()  # what the last write left buffered: a reader gone by now is told here
        if signal.SIGPIPE in inbox.received:  # stdout went before the last line was out: nothing more to say
            return 128 + signal.SIGPIPE
        return followed(job, records, view, logs, timeline, show_end,
                        f"ddp-report {args.cluster or 'CLUSTER.yaml'} {job_id}")


def followed(job, records: list, view, logs, timeline: Timeline | None, show_end: bool, again: str) -> int:
    """A replay's end: the run logs' summary and the timeline's end (once the job has ended
    everywhere), the job's end on the screen, its page (``again`` makes it anew), the nodes not
    read. The exit status."""
    result = job.result()
    problems = [s.problem for s in job.status if s.problem is not None]
    ended = all(s.terminal and s.state != "error" for s in job.status)
    shown = records if len(records) > 1 else ()  # a job that never restarted: as before restarts
    if ended:
        logs.finished(result, attempts=shown)
        if timeline is not None:
            timeline.finished(result, attempts=records)
    if show_end and ended:
        view.finished(result, attempts=shown)
    if timeline is not None:
        report_notice(logs.dir, view, again)
    for p in problems:
        view.notice(p.render())
    if problems or all(s.state in ("error", "lost") for s in job.status):  # a node not read: the docs' 3
        return 3
    return result.exit_code if show_end else EXIT_OK


class NoLogs:
    """In place of RunLogs when an attach starts from a tail."""

    def __enter__(self) -> NoLogs:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def finished(self, result, attempts=()) -> None:
        pass


class LinesView(ConsoleView):
    """ddp-logs: the lines alone, no job banner."""

    def intro(self, plan: LaunchPlan) -> None:
        pass


class NoLinesView(LinesView):
    """ddp-report: ddp-up's own notices alone, not the job's lines."""

    def lines(self, node, lines) -> None:
        pass

    def bars(self, node, bars, at=None) -> None:
        pass


# --- ddp-ls ---------------------------------------------------------------------------------

def ls_parser() -> argparse.ArgumentParser:
    p = Parser(prog="ddp-ls", description="The detached jobs on the cluster's nodes, running and "
                                                         "finished (kept 7 days, or until ddp-kill --purge). With no "
                                                         "cluster file: the detached jobs started from here (their "
                                                         "runs in --runs-dir), asked of their nodes.")
    p.add_argument("cluster", metavar="CLUSTER.yaml", nargs="?", help="the cluster file")
    add_node_sources(p)
    p.add_argument("--runs-dir", default="runs", metavar="DIR", help="with no cluster file: where ddp-up kept the "
                                                                      "runs it started (default: runs)")
    p.add_argument("--json", action="store_true", help="one JSON object per job, for scripts")
    return p


@dataclasses.dataclass
class JobRow:
    job: str
    script: str
    state: str  # running | restarting | done | failed | stopped | lost (a node's: also away, left out by an elastic job)
    ranks: int
    started: float | None
    ended: float | None
    exit_status: int | None
    root_cause: str | None
    nodes: dict  # node index -> its state
    attempt: int = 0  # a job that restarted (restarts:): its latest attempt
    attempts: tuple[str, ...] = ()  # a job that restarted and ended: how each attempt ended, in order
    commit: str | None = None  # the git commit it ran from (runrecord.py), where ddp-up was run in a checkout

    def duration(self, now: float) -> float | None:
        return None if self.started is None else (self.ended or now) - self.started


def merge_records(records: list[dict]) -> list[JobRow]:
    """Every node's records of every job -> one row per job (pure; the state of the whole job is
    its worst node's: running while any node runs, then failed, lost, stopped, done)."""
    by_job: dict[str, dict] = {}
    for record in records:  # nodes that share a state directory (local ones) report each other's too
        by_job.setdefault(str(record.get("job")), {})[record.get("node")] = record
    rows = []
    for job, by_node in sorted(by_job.items()):
        recs = list(by_node.values())
        labels = {r.get("node"): r.get("label") or f"node {r.get('node')}" for r in recs}
        current = max(attempt_of(r) for r in recs)
        # an elastic job's node left out of the current attempt (lost, not yet taken back) still
        # says what it last ran: it is away, and its ranks are not the job's now
        # its supervisor's outcome: the job is over; a node still waiting to be taken back is away
        outcome = next((r["outcome"] for r in recs if r.get("outcome")), None)
        recs = [dict(r, state="away") if r.get("state") in ("running", "restarting") and (
                attempt_of(r) < current or (outcome and r.get("state") == "restarting")) else r for r in recs]
        states = {r.get("node"): r.get("state") for r in recs}
        state = next((s for s in ("running", "restarting", "failed", "lost", "stopped") if s in states.values()),
                     "done")
        live = state in ("running", "restarting")
        root = (outcome or {}).get("root_cause")
        ended = None if live else max((r.get("ended") or 0 for r in recs), default=None) or None
        if root and root.get("state") in ("hung", "lost") and state == "stopped":
            state = "failed" if root["state"] == "hung" else "lost"  # its supervisor stopped it for that
        rows.append(JobRow(job, str(recs[0].get("script") or "?"), state,
                           sum((r.get("ranks") or [0, 0])[1] for r in recs if r.get("state") != "away"),
                           min((r["started"] for r in recs if r.get("started")), default=None), ended,
                           None if live else (0 if state == "done" else 1),
                           describe_root(root, labels),
                           {str(k): v for k, v in sorted(states.items(), key=lambda kv: str(kv[0]))},
                           current, attempt_ends(outcome, labels),
                           next((str(r["commit"])[:40] for r in recs if r.get("commit")), None)))
    return rows


def attempt_of(record: dict) -> int:
    attempt = record.get("attempt")
    return attempt if isinstance(attempt, int) and not isinstance(attempt, bool) else 0


def attempt_ends(outcome: dict | None, labels: dict) -> tuple[str, ...]:
    """How each attempt of a job that restarted ended ("attempt 0: h1 (node 1, rank 1) failed
    (exit code 7)"), from its supervisor's outcome; () for a job of one attempt."""
    attempts = (outcome or {}).get("attempts")
    if not isinstance(attempts, list) or len(attempts) < 2:
        return ()
    return tuple(f"attempt {a.get('attempt', i)}: {attempt_words(a, labels)}"
                 + (f" -> {a['next']}" if isinstance(a.get("next"), str) and a.get("root_cause") else "")
                 for i, a in enumerate(attempts) if isinstance(a, dict))


def attempt_words(attempt: dict, labels: dict) -> str:
    """How one attempt ended: stopped by its supervisor to change its nodes (a grow: no failure,
    whatever exit status the stop left), else its root cause, else done."""
    reshaped = attempt.get("reshaped")
    if isinstance(reshaped, str) and reshaped in RESHAPES:
        return RESHAPES[reshaped]
    return describe_root(attempt.get("root_cause"), labels) or "done"


def describe_root(root: dict | None, labels: dict) -> str | None:
    """The supervisor's root cause in words: the node that failed first, or the hang."""
    if root is None:
        return None
    if root.get("node") is None:
        return root.get("reason") or policy.HUNG
    rank = f", rank {root['rank']}" if root.get("rank") is not None else ""
    text = f"{labels.get(root['node'], '?')} (node {root['node']}{rank}) {root.get('state')}"
    if root.get("code") is not None:
        text += f" (exit code {root['code']})"
    return text + "".join(f": {root[key]}" for key in ("reason", "exception") if root.get(key))


def main_ls(argv: list[str] | None = None) -> int:
    args = ls_parser().parse_args(sys.argv[1:] if argv is None else argv)
    console = table_console()
    here = detached_here(args.runs_dir) if args.cluster is None and not any(
        getattr(args, flag, None) for flag in ("hosts", "hostfile", "slurm")) else None
    if here == {}:
        return report("ddp-ls", UsageError(f"no detached job was started from here (none in {args.runs_dir}/): name a "
                                           "cluster file to ask its nodes, e.g. ddp-ls cluster.yaml"))
    clusters = [(load_or_report(argparse.Namespace(**{**vars(args), "cluster": path}), "ddp-ls", forward=False,
                                jobs=EVERY_JOB), jobs)
                for path, jobs in here.items()] if here else [(load_or_report(args, "ddp-ls", forward=False,
                                                                              jobs=EVERY_JOB), None)]
    clusters = [(config, jobs) for config, jobs in clusters if config is not None]
    if not clusters:
        return EXIT_USAGE
    with signals.recording(), ssh_connections():
        try:
            asked = [(list_jobs(list(config.nodes)), jobs) for config, jobs in clusters]
        except Interrupted as e:
            return interrupted("ddp-ls", e, "before every node answered")
    replies = [r for answers, _ in asked for r in answers]
    records = [rec for answers, jobs in asked for r in answers if r.problem is None for rec in r.frames[wire.Jobs].jobs
               if jobs is None or rec.get("job") in jobs]  # with no cluster file named, the jobs started from here
    rows = merge_records(records)
    now = time.time()
    pages = {row.job: page_of(args.runs_dir, row.job) for row in rows}
    if args.json:
        for row in rows:
            print(json.dumps(dict(dataclasses.asdict(row), duration=row.duration(now), report=pages[row.job])))
    elif rows:
        console.print(ls_table(rows, now))
        for row in rows:
            if pages[row.job] or row.state not in ("running", "restarting"):
                console.print(outside(f"ddp-ls: {row.job}: report {pages[row.job]}" if pages[row.job] else
                                      f"ddp-ls: {row.job}: no report here yet (ddp-report CLUSTER.yaml {row.job})"))
    else:
        console.print("ddp-ls: no detached jobs on these nodes (ddp-up --detach starts one)", markup=False, highlight=False)
    for r in replies:
        if r.problem is not None:
            console.print(f"ddp-ls: {r.problem.render()} (its jobs are not listed)", markup=False, highlight=False)
        for skipped in (r.frames[wire.Jobs].skipped or ()) if r.problem is None else ():
            console.print(outside(f"ddp-ls: {r.node.label}: passed over {str(skipped)} (remove it, or ddp-kill --purge)"))
    return 3 if any(r.problem for r in replies) else EXIT_OK


def page_of(runs_dir: str, job: str) -> str | None:
    """The job's report page (views/report.py) where this machine has one, in ``runs_dir``."""
    path = os.path.join(runs_dir, job, REPORT)
    return path if os.path.isfile(path) else None


def list_jobs(nodes: list) -> list:
    """Every node's answer to a ListSpec (its records), in parallel."""
    return on_each(nodes, lambda n: call_agent(n, wire.ListSpec(), n.ssh.connect_timeout + LIST_LIMIT,
                                               until=wire.Jobs), name="ls")


def job_anywhere(nodes: list, job_id: str) -> tuple[bool, str | None, str | None]:
    """(whether a detached job ``job_id`` may be on these nodes: False only when every node
    answered and none keeps its record (each writes it before the job starts there); its master,
    ``addr:port``, and its script, as a record says, or None)."""
    replies = list_jobs(nodes)
    records = [rec for r in replies if r.problem is None for rec in r.frames[wire.Jobs].jobs if rec.get("job") == job_id]
    master = next((rec["master"] for rec in records if isinstance(rec.get("master"), str)), None)
    script = next((rec["script"] for rec in records if isinstance(rec.get("script"), str) and rec["script"]), None)
    if any(r.problem is not None for r in replies):
        return True, master, script  # a node that cannot say: following it reports why
    return bool(records), master, script


def ls_table(rows: list[JobRow], now: float) -> Table:
    table = Table(title="ddp-ls", title_justify="left")
    commits = any(row.commit for row in rows)  # the column only where some job ran from a checkout
    for column in ("job", "script", *(("commit",) if commits else ()), "state", "ranks", "started", "duration", "exit"):
        table.add_column(column, no_wrap=True)
    table.add_column("root cause")
    for row in rows:
        duration = row.duration(now)
        table.add_row(outside(row.job), outside(row.script), *((outside((row.commit or "-")[:10]),) if commits else ()),
                      outside(row.state + (f" (attempt {row.attempt})" if row.attempt else "")), str(row.ranks),
                      "-" if row.started is None else time.strftime("%m-%d %H:%M", time.localtime(row.started)),
                      "-" if duration is None else f"{duration:.0f} s",
                      "-" if row.exit_status is None else str(row.exit_status),
                      Text("\n").join(outside(line) for line in row.attempts) if row.attempts  # each line made safe,
                      else outside(row.root_cause or ""))  # not their breaks
    return table
