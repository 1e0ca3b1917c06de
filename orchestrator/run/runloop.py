"""The run: one attempt after another (attempts.py decides who runs and whether another comes),
each an ordinary Job to its end, until one succeeds, none is left, or a signal ends the run."""

from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Callable

from ..diagnose.outcome import JobResult
from ..errors import EXIT_INTERNAL, EXIT_OK, SetupError
from ..job.events import Reshape
from ..job.loop import Job
from ..plan.call import Call
from ..plan.launch import LaunchPlan
from ..remote import signals
from ..views.callback import Line, LineCallback
from ..views.console import ConsoleView
from ..views.fanout import Fanout
from ..views.logfiles import RunLogs
from ..views.metricsfile import MetricsFile
from ..views.report import REPORT, make_report
from ..views.timeline import Timeline
from .attempts import RESHAPED, AttemptRecord, Restarts, attempt_record, blame, blame_setup, delay_before, wait_for_signal
from .notifier import Notifier

# Seconds a restart waits, past its delay, for the nodes away from the run to answer (a connect
# timeout and an agent's start): one that has not answered by then stays away this attempt.
ASK_MOST = 30.0


@dataclass(frozen=True)
class Caller:
    """What a run started from Python (api.py) adds to the command line's: the function its ranks
    run, where the final result goes (its ranks' values), and a function for every line."""

    call: Call | None = None
    on_result: Callable[[JobResult], None] | None = None
    on_line: Callable[[Line], None] | None = None
    kept: Callable[[LaunchPlan], LaunchPlan] | None = None  # warm: the kept interpreters (kept.Kept) to fork from
    page_behind: bool = False  # the run's page made on a thread of its own: the call returns without waiting for it


def run_job(plan: LaunchPlan, console_view: ConsoleView, logs: RunLogs, preflight: bool = True,
            inbox: signals.SignalInbox = signals.INBOX, cluster_arg: str = "CLUSTER.yaml",
            restarts: Restarts | None = None, notifier: Notifier | None = None, caller: Caller = Caller()) -> int:
    """Run to completion. Signals are the job loop's events: the first stops every node
    gracefully, the second kills now; either way the exit status is 128+N. A detached job's run
    ends once every node runs (exit 0), the job going on under its own agents. With
    ``restarts``, a failed attempt is followed by the next one (attempts.py) until one succeeds or none is left."""
    timeline, metrics, views = views_for(plan, console_view, logs, notifier, caller)
    records: list[AttemptRecord] = []
    swept_later: list[Job] = []  # attempts whose lost nodes are still being swept: the next one need not wait
    pages = PagesMeanwhile(logs.dir) if timeline else nullcontext()
    with console_view, logs, timeline or nullcontext(), metrics or nullcontext(), pages:
        while True:
            plan = caller.kept(plan) if caller.kept else plan  # warm: interpreters kept from one attempt to the next
            job = Job(plan, views, preflight=preflight, inbox=inbox, shown=console_view.ranks)
            started = time.time()
            result, cause, unstarted = run_attempt(job, plan, views, logs, records, restarts)
            swept_later.append(job)
            if job.detached:
                return detached_notices(plan, console_view, cluster_arg)
            records.append(attempt_record(plan, result, started, cause, could_not_start=unstarted, went=job.went,
                                          reshape=job.reshape))
            if restarts is None or records[-1].end in ("succeeded", "stopped") or not restarts.follows(result):
                break
            restarts.vet(job.status)
            if records[-1].end in RESHAPED:
                following, signum, why = reshaped_attempt(plan, job.reshape, restarts, views)
            else:  # a grow overtaken by a failure or a loss still takes back the nodes that answered
                for text in restarts.welcome_asked(job.reshape, result):
                    views.notice(text)
                following, signum, why = next_attempt(plan, result, cause, restarts, views, inbox, records)
            records[-1] = replace(records[-1], next=why)
            if signum is not None:
                result = replace(result, interrupted=signum)
            if following is None:
                break
            plan = following
            views.attempt(plan)
        settle(result, records, swept_later, restarts, (logs, timeline, metrics, console_view), caller, notifier)
    if metrics is not None and metrics.said():
        console_view.notice(metrics.said())
    console_view.notice(f"logs: {logs.dir}")
    if timeline is not None:
        again = f"ddp-report {os.path.basename(logs.dir)}"
        if caller.page_behind:  # a Python session's next call starts meanwhile (the thread is waited for at exit)
            console_view.notice(f"report: {os.path.join(logs.dir, REPORT)} (being made)")
            threading.Thread(target=report_notice, args=(logs.dir, console_view, again, True), name="ddp-up-page").start()
        else:
            report_notice(logs.dir, console_view, again)
    return result.exit_code


class PagesMeanwhile:
    """While a run goes on, its page is made again every PAGE_EVERY seconds (on a thread of its
    own, from the files the run keeps writing), so a long run's page is there before its end; it
    says it is partial. The last one is the run's end's."""

    PAGE_EVERY = 300.0

    def __init__(self, where: str):
        self.where, self.over = where, threading.Event()
        self.thread = threading.Thread(target=self.keep_making, name="ddp-up-pages", daemon=True)

    def __enter__(self) -> PagesMeanwhile:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.over.set()
        self.thread.join(60)

    def keep_making(self) -> None:
        while not self.over.wait(self.PAGE_EVERY):
            try:
                make_report(self.where)
            except Exception:  # noqa: BLE001 - a picture of the run, never a reason to fail it: the end's says why
                pass


def views_for(plan: LaunchPlan, console_view: ConsoleView, logs: RunLogs, notifier: Notifier | None,
              caller: Caller) -> tuple[Timeline | None, MetricsFile | None, Fanout]:
    """The run's views: the screen, the logs, the notify targets, the timeline (its page's), the
    metrics, a Python caller's line callback; the timeline and the metrics, and all of them as one."""
    timeline = Timeline(logs.dir, plan) if plan.report else None
    metrics = metrics_for(plan, logs, console_view)
    views = Fanout(console_view, logs, *(v for v in (notifier, timeline, metrics) if v is not None),
                   *((LineCallback(caller.on_line, console_view.notice),) if caller.on_line else ()))
    return timeline, metrics, views


def metrics_for(plan: LaunchPlan, logs: RunLogs, console_view: ConsoleView) -> MetricsFile | None:
    """What the ranks print, read for metrics (views/metricsfile.py), where `metrics:` is not false;
    the live dashboard shows the first one."""
    if plan.metrics is None or plan.detach:
        return None
    metrics = MetricsFile(logs.dir, plan)
    if hasattr(console_view, "metric"):
        console_view.metric = metrics.shown
    return metrics


def settle(result: JobResult, records: list[AttemptRecord], swept: list[Job], restarts: Restarts | None,
           views: tuple, caller: Caller, notifier: Notifier | None) -> None:
    """The run's end, in order: the sweeps of its lost nodes said, the watch of its away nodes
    ended, each of ``views`` finished (summary.json, then the timeline's end, then the screen's),
    the Python caller given its ranks' values, the notify targets told."""
    for i, job in enumerate(swept):  # a node back: it answered again, and a later attempt's Go reached it
        job.report_sweeps(frozenset(n.label for later in swept[i + 1:] if later.went is not None for n in later.plan.nodes))
    if restarts is not None:
        restarts.close()
        for text in restarts.unfit():  # why a run that ends smaller did not grow back
            views[-1].notice(text)
    for view in views:
        if view is not None:
            view.finished(result, attempts=records)
    if caller.on_result is not None:
        caller.on_result(result)
    if notifier:
        notifier.finished(result, attempts=records)
        notifier.close()


def report_notice(where: str, view, again: str, named: bool = False) -> None:
    """The run's page (views/report.py), made and named in its last lines (``named``: it was
    already). A report that cannot be made (a full disk, a damaged file) is said, with ``again``,
    the command that tries again, and changes nothing else: the run's status is its own."""
    try:
        made = make_report(where)
        if not named:
            view.notice(f"report: {made}")
    except Exception as e:  # the report is a picture of the run: never a reason to fail it
        view.notice(f"no report ({type(e).__name__}: {str(e)[:300]}); {again} tries again")


def run_attempt(job: Job, plan: LaunchPlan, views, logs: RunLogs, records: list[AttemptRecord],
                restarts: Restarts | None) -> tuple[JobResult, tuple[str | None, bool], bool]:
    """One attempt to its end: its result, what to blame, and whether it could not start.
    Re-raises what ends the run at once: a bug, or a setup error of the first attempt (a later
    one's, a spare not fit to run, is that attempt's failure: the next one may do without it).
    Meanwhile the nodes away from a smaller run are watched (Restarts.watch_away)."""
    restarting = restarts is not None and restarts.any
    watch = restarts.watch_away(job.grow) if restarting else None
    try:
        result = job.run()
    except SetupError as e:
        job.close()
        if not restarting or plan.attempt == 0:
            logs.finished(job.result(), exit_code=e.exit_code, attempts=records)
            raise
        views.notice(f"attempt {plan.attempt} could not start: {e.problems[0].render()}")
        return replace(job.result(), failures=()), blame_setup(e.problems), True
    except BaseException as e:  # a bug: record it and give the terminal back
        job.close()
        logs.finished(job.result(), exit_code=getattr(e, "exit_code", EXIT_INTERNAL), attempts=records)
        raise
    finally:
        if watch is not None:
            watch.close()
    job.close(sweeps=not restarting)
    return result, blame(result), False


def next_attempt(plan: LaunchPlan, result: JobResult, cause: tuple[str | None, bool], policy: Restarts, views,
                 inbox: signals.SignalInbox, records: list[AttemptRecord]) -> tuple[LaunchPlan | None, int | None, str]:
    """The plan of the attempt after ``plan`` (None: no more), after its delay; the signal that
    ended the wait, if one did (a signal ends the run for good); and what came next, for the record."""
    last = records[-1]
    nxt = policy.after(result, records, cause)
    if nxt.notice:
        views.notice(nxt.notice)
    if nxt.cluster is None:
        if nxt.why != nxt.notice:
            views.notice(f"attempt {plan.attempt} {last.end}: {nxt.why}")
        return None, None, nxt.why
    delay = delay_before(1, 0) if nxt.at_once else delay_before(plan.attempt + 1, policy.delay)
    views.notice(f"attempt {plan.attempt} {last.end} ({last.root_cause or 'see above'}); attempt {plan.attempt + 1} "
                 f"({nxt.why}) in {delay:g} s (Ctrl-C stops for good)")
    views.event("restart", f"job {plan.job_id}: attempt {plan.attempt} {last.end} ({last.root_cause or 'no root cause'}); "
                           f"attempt {plan.attempt + 1} ({nxt.why}) in {delay:g} s",
                attempt=plan.attempt + 1, root_cause=last.root_cause)
    asking = policy.ask_away()  # the nodes away from the run, asked meanwhile whether they answer again
    signum = wait_for_signal(inbox, delay)
    deadline = time.monotonic() + ASK_MOST
    while signum is None and asking is not None and not asking.done.is_set() and time.monotonic() < deadline:
        signum = wait_for_signal(inbox, 0.1)
    if signum is not None:
        why = f"{signal.Signals(signum).name} while waiting to restart: no new attempt"
        views.notice(why)
        return None, signum, why
    welcomed = policy.welcome(asking)  # the away nodes that answered come back, then the next plan
    following, said = policy.following(plan.attempt + 1)
    for text in welcomed + said:
        views.notice(text)
    return following, None, nxt.why if following is not None else said[-1]  # nxt's, with who rejoined


def reshaped_attempt(plan: LaunchPlan, ask: Reshape, policy: Restarts, views) -> tuple[LaunchPlan | None, None, str]:
    """The attempt after one stopped to change its nodes: at once, with the nodes that answered
    again, or without the straggler (None: none can follow); what came next, for the record."""
    following, said, why = policy.reshape(ask, plan.attempt + 1)
    for text in said:
        views.notice(text)
    if following is None:
        return None, None, why
    views.event("restart", f"job {plan.job_id}: attempt {plan.attempt} {ask.end}; attempt {plan.attempt + 1} "
                           f"({why}) now", attempt=plan.attempt + 1, root_cause=None)
    return following, None, why


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
    if plan.min_nodes is not None:
        back = "never while it runs" if plan.rejoin_after is None else f"once it has answered for {plan.rejoin_after:g} s"
        console_view.notice(f"a node lost is left out while at least {plan.min_nodes} node(s) remain (min_nodes:); "
                            f"it is taken back {back} (rejoin_after:)")
    return EXIT_OK
