"""The run's report page: what a real run kept (timeline.jsonl) drawn on one self-contained page,
loaded in headless Chromium (Debian's): no console error, each chart's points read back equal to
the kept data, and a rank's hostile bar text shown, never run.

The nodes are `transport: local` (the page's subject is the controller's, not the transport's)."""

from __future__ import annotations

import csv
import functools
import html
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.harness import runner
from tests.harness.runner import RUNS_ROOT, ddp_up, run_dir
from tests.integration.test_progress import BARS, job_of

local_cluster = functools.partial(runner.local_cluster, launcher="none")
pytest.importorskip("tqdm")
HOSTILE = '</script><script>window.__pwned=1</script><img src=x onerror="window.__pwned=2">'
READER = """<script>function ddpUpRead() {
  if (document.getElementById('read-back')) return;
  var out = {pwned: window.__pwned || null, charts: {}};
  document.querySelectorAll('.js-plotly-plot').forEach(function (d) {
    out.charts[d.id] = d.data.map(function (t) {
      return {name: t.name, x: Array.from(t.x || []), y: Array.from(t.y || []), hovertext: t.hovertext || null};
    });
  });
  var pre = document.createElement('pre'); pre.id = 'read-back'; pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
}
// the page unpacks Plotly and draws its charts asynchronously: read once it says they are drawn
if (window.ddpUpDrawn) { setTimeout(ddpUpRead, 300); } else {
  document.addEventListener('ddp-up-drawn', function () { setTimeout(ddpUpRead, 300); });
}</script>"""


def in_chromium(page, tmp_path) -> tuple[dict, list[str]]:
    """The page, with a reader script added at its end, loaded in headless Chromium: what the
    reader found (each chart's traces, whether the page's own text ran), and every console line."""
    chromium = shutil.which("chromium")
    assert chromium, "the report's tests load it in Debian's chromium: apt-get install chromium"
    copy = tmp_path / "read.html"
    copy.write_text(page.read_text().replace("</body>", READER + "</body>"))
    done = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr",
                           "--v=0", "--virtual-time-budget=30000", "--dump-dom", copy.as_uri()],
                          capture_output=True, text=True, timeout=120)
    found = re.search(r'<pre id="read-back">(.*?)</pre>', done.stdout, re.S)
    assert found, (done.stdout[-2000:], done.stderr[-2000:])
    return json.loads(html.unescape(found.group(1))), [l for l in done.stderr.splitlines() if ":CONSOLE" in l]


def test_a_run_leaves_a_page_that_draws_what_it_kept_and_runs_nothing_a_rank_printed(tmp_path):
    path = local_cluster(tmp_path, report=True, env={"OMP_NUM_THREADS": 1, "BAR_DESC": HOSTILE})
    code, out, _ = ddp_up("--no-dashboard", str(path), BARS, "tqdm", "25", "0.08", timeout=90)
    assert code == 0, out
    job = job_of(out)
    where = run_dir(job)
    assert out.rstrip().endswith(f"ddp-up report: {RUNS_ROOT}/{job}/report.html"), out
    kept = [json.loads(line) for line in (where / "timeline.jsonl").read_text().splitlines()]
    assert kept[0]["kind"] == "run" and kept[-1] == {"kind": "end", "t": kept[-1]["t"], "exit_status": 0}, kept
    progress = {s["rank"]: s for s in kept if s["kind"] == "progress"}
    assert sorted(progress) == [0, 1] and all(s["desc"].startswith(HOSTILE) for s in progress.values()), kept
    assert {s["node"] for s in kept if s["kind"] == "state" and s["state"] == "done"} == {"local-0", "local-1"}

    read, console = in_chromium(where / "report.html", tmp_path)
    assert console == [] and read["pwned"] is None, (console, read["pwned"])
    assert {"chart-timeline", "chart-rate", "chart-lines"} <= set(read["charts"]), read["charts"].keys()
    drawn = {t["name"]: t for t in read["charts"]["chart-rate"]}
    for rank, s in progress.items():
        trace = drawn[f"rank {rank} (local-{rank})"]
        assert trace["x"] == [p[0] for p in s["points"]] and trace["y"] == [p[2] for p in s["points"]], (trace, s)
        assert trace["hovertext"] == html.escape(s["desc"])  # shown as the text it was
    lines = {t["name"] for t in read["charts"]["chart-lines"]}
    assert lines == {"rank 0 (local-0)", "rank 1 (local-1)"}, lines
    page = (where / "report.html").read_text()
    assert HOSTILE not in page and "window.__pwned=1" not in page.replace("\\u003c", "<").split("<script>")[0]


def test_the_page_draws_each_metric_a_rank_printed_first_as_it_printed_it(tmp_path):
    """What the run learned, read back from the page in Chromium: each rank's loss, step by step,
    as the rank printed it and as metrics.csv keeps it; the metrics come before the machine's charts."""
    from tests.integration.conftest import SCRIPT

    path = local_cluster(tmp_path, report=True, metrics=True, env={"OMP_NUM_THREADS": 1, "TICK_SAYS_LOSS": 1})
    code, out, _ = ddp_up("--no-dashboard", str(path), SCRIPT, "tick", "6", "0.02", timeout=90)
    assert code == 0, out
    printed = {}
    for rank, step, loss in re.findall(r"^local-\d r(\d) \| step (\d+) loss ([\d.]+)$", out, re.M):
        printed.setdefault(int(rank), []).append((int(step), float(loss)))
    where = run_dir(job_of(out))
    with open(where / "metrics.csv", newline="") as f:
        kept = {(int(r["rank"]), int(float(r["step"])), float(r["value"])) for r in csv.DictReader(f)}
    assert kept == {(rank, s, v) for rank, pts in printed.items() for s, v in pts} and len(kept) == 12, (kept, printed)
    read, console = in_chromium(where / "report.html", tmp_path)
    assert console == [], console
    drawn = {t["name"]: t for t in read["charts"]["chart-metric-0"]}
    for rank, pts in printed.items():
        assert list(zip(drawn[f"rank {rank}"]["x"], drawn[f"rank {rank}"]["y"])) == pts, (drawn, printed)
    page = (where / "report.html").read_text()
    assert page.index("chart-metric-0") < page.index("chart-timeline") and os.path.getsize(where / "report.html") < 1.5e6


def test_a_run_cut_short_without_bars_or_gpus_still_gets_a_page_that_says_what_is_missing(tmp_path):
    """No progress bar, no GPU, a timeline without its end (a controller killed mid-run) and no
    summary: the page shows the timeline and lines a second, and says what it lacks."""
    from orchestrator.views.report import make_report

    where = tmp_path / "runs" / "J1"
    where.mkdir(parents=True)
    kept = [{"kind": "run", "job": "J1", "started": 1.7e9, "format": 1},
            {"kind": "attempt", "attempt": 0, "start": 0.0, "end": None, "nodes": ["a", "b"], "world_size": 2},
            *({"kind": "state", "t": t, "node": n, "attempt": 0, "state": st, "reason": None}
              for n in "ab" for t, st in ((0.0, "connecting"), (1.0, "running"))),
            *({"kind": "lines", "rank": r, "node": "ab"[r], "step": 2.0, "points": [[1.0, 2.0], [3.0, 4.5]]}
              for r in (0, 1))]
    (where / "timeline.jsonl").write_text("".join(json.dumps(k) + "\n" for k in kept) + '{"kind": "lines", "ra')
    (where / "run.json").write_text(json.dumps({"command": ["ddp-up", "c.yaml", "t.py"], "cwd": "/w"}))
    read, console = in_chromium(Path(make_report(str(where))), tmp_path)
    assert console == [] and set(read["charts"]) == {"chart-timeline", "chart-lines"}, read["charts"].keys()
    assert [t["y"] for t in read["charts"]["chart-lines"]] == [[2.0, 4.5]] * 2
    page = (where / "report.html").read_text()
    for said in ("its timeline has none yet", "summary.json: missing", "progress bars: the run had none",
                 "GPUs reported: the run had none", "ddp-up c.yaml t.py"):
        assert said in page, said
