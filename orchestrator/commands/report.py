"""ddp-report: a run's page (views/report.py), made again from ``runs/<job>/`` (ddp-up writes one
at each run's end), or, given the cluster file, made for a detached job, running or ended: its
nodes' journals replayed into the run logs and its timeline as ddp-attach does, then the page."""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

from ..errors import EXIT_OK, DdpUpError, UsageError
from ..plan.launch import check_job_id
from ..views.report import make_report
from .attach import NoLinesView, _follow, _parser
from .common import is_cluster_file, report

EXIT_NO_RUN = 3


def report_parser() -> argparse.ArgumentParser:
    p = _parser("ddp-report", "Make a run's report page, runs/<job>/report.html: again from what the run left "
                              "in runs/<job>/ (ddp-report JOB), or for a detached job, from its nodes' logs "
                              "(ddp-report CLUSTER.yaml JOB); or one page that compares runs (ddp-report JOB JOB ...).")
    p.add_argument("more", nargs="*", metavar="JOB", help="more runs: one page compares them all")
    p.add_argument("--runs-dir", default="runs", metavar="DIR", help="where the job's logs are (DIR/<job>/)")
    return p


def compare(jobs: list[str], runs_dir: str) -> int:
    """``ddp-report JOB JOB ...``: one page that compares the runs, in runs_dir; where it is."""
    from ..views.compare import make_comparison

    ids = [check_job_id(job, "JOB") for job in jobs]
    absent = [job for job in ids if not os.path.isdir(os.path.join(runs_dir, job))]
    if absent:
        print(f"ddp-report: no run {', '.join(absent)} in {runs_dir}/", file=sys.stderr)
        return EXIT_NO_RUN
    name = "-".join(ids[:3]) + (f"-and-{len(ids) - 3}-more-{hashlib.sha256(' '.join(ids).encode()).hexdigest()[:8]}"
                                if len(ids) > 3 else "")
    page = make_comparison([os.path.join(runs_dir, job) for job in ids], os.path.join(runs_dir, f"compare-{name}.html"))
    print(f"ddp-report compared {len(ids)} runs: {page}")
    return EXIT_OK


def main_report(argv: list[str] | None = None) -> int:
    args = report_parser().parse_args(sys.argv[1:] if argv is None else argv)
    nodes_named = args.hostfile or args.hosts or args.slurm
    if args.job is not None and not nodes_named and not is_cluster_file(args.cluster):
        try:
            return compare([args.cluster, args.job, *args.more], args.runs_dir)
        except DdpUpError as e:
            return report("ddp-report", e)
        except OSError as e:
            print(f"ddp-report: cannot write the page in {args.runs_dir}/: {e.strerror or e}", file=sys.stderr)
            return 1
    if args.more:
        return report("ddp-report", UsageError("more than one JOB compares runs: ddp-report JOB JOB ...; "
                                               "a detached job's page: ddp-report CLUSTER.yaml JOB"))
    here = args.job is None and not nodes_named and (args.cluster is None or not is_cluster_file(args.cluster))
    if not here:
        args.tail, args.dashboard, args.collapse, args.ranks = None, False, False, None
        return _follow("ddp-report", args, follow=False, show_end=False, page=True, plain=NoLinesView)
    try:
        if args.cluster is None:
            raise UsageError("missing JOB: ddp-report JOB, or ddp-report CLUSTER.yaml JOB for a detached job")
        job = check_job_id(args.cluster, "JOB")
        where = os.path.join(args.runs_dir, job)
        if not os.path.isdir(where):
            print(f"ddp-report: no run {job} in {args.runs_dir}/ (a detached job's: ddp-report CLUSTER.yaml {job})",
                  file=sys.stderr)
            return EXIT_NO_RUN
        print(f"ddp-report report: {make_report(where)}")
        return EXIT_OK
    except DdpUpError as e:
        return report("ddp-report", e)
    except OSError as e:
        print(f"ddp-report: cannot write the report in {args.runs_dir}/{args.cluster}: {e.strerror or e}",
              file=sys.stderr)
        return 1
