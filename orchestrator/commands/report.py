"""ddp-report: a run's page (views/report.py), made again from ``runs/<job>/`` (ddp-up writes one
at each run's end), or, given the cluster file, made for a detached job, running or ended: its
nodes' journals replayed into the run logs and its timeline as ddp-attach does, then the page."""

from __future__ import annotations

import argparse
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
                              "(ddp-report CLUSTER.yaml JOB).")
    p.add_argument("--runs-dir", default="runs", metavar="DIR", help="where the job's logs are (DIR/<job>/)")
    return p


def main_report(argv: list[str] | None = None) -> int:
    args = report_parser().parse_args(sys.argv[1:] if argv is None else argv)
    here = args.job is None and not (args.hostfile or args.hosts or args.slurm) and \
        (args.cluster is None or not is_cluster_file(args.cluster))
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
