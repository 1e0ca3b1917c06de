"""Progress-bar workload for the issue-29 tests (no torch). Modes:

  bars.py tqdm STEPS STEP_S     every rank: a real tqdm bar on stderr over STEPS steps, STEP_S apart,
                                a tqdm.write line halfway, then "done rank=R" on stdout
  bars.py hand STEPS STEP_S     the same drawn by hand: "\\r step i/STEPS [eta, rate]" on stderr, then a newline
  bars.py nested OUTER INNER STEP_S   tqdm's nested bars (outer epochs, inner steps: cursor-up), then "done"
  bars.py own STEPS STEP_S      no bar: "progress: i/STEPS" lines on stdout (ddp-up's own form)
  bars.py rich STEPS STEP_S     a Rich progress bar on stdout, as Lightning's RichProgressBar draws it
                                ("train ━━━ 12/40 0:00:01 • 0:00:03 9.87it/s"), then "done"
  bars.py richlines STEPS STEP_S   a live Rich bar, and halfway a 150-character line and a warning
                                (Rich prints both itself while its bar is live)
  bars.py flood N [PREFIX]      every rank draws N "\\r" updates as fast as it can (flushed each, as tqdm
                                does), then a newline, to stderr or to PREFIX.<rank>; then its own timing:
                                "FLOOD rank=R updates=N seconds=S" on stdout
"""

import os
import sys
import time

RANK = int(os.environ.get("RANK", "0"))


def real_tqdm(steps, step_s):
    from tqdm import tqdm

    for i in tqdm(range(steps), desc=os.environ.get("BAR_DESC", "train"), mininterval=0, miniters=1):
        time.sleep(step_s)
        if i == steps // 2:
            tqdm.write("halfway rank=%d" % RANK)


def hand(steps, step_s):
    start = time.time()
    for i in range(1, steps + 1):
        time.sleep(step_s)
        rate = i / (time.time() - start)
        sys.stderr.write("\rstep %3d%%| %d/%d [00:%02d<00:%02d, %.2fit/s]" % (
            100 * i // steps, i, steps, int(time.time() - start), int((steps - i) / rate), rate))
        sys.stderr.flush()
    sys.stderr.write("\n")


def nested(outer, inner, step_s):
    from tqdm import tqdm

    for _ in tqdm(range(outer), desc="epoch", mininterval=0, miniters=1):
        for _ in tqdm(range(inner), desc="step", leave=False, mininterval=0, miniters=1):
            time.sleep(step_s)


def rich(steps, step_s):
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)
    from rich.text import Text

    class Speed(ProgressColumn):  # Lightning's ProcessingSpeedColumn: "9.87it/s"
        def render(self, task):
            return Text("%.2fit/s" % (task.speed or 0))

    with Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("•"),
                  TimeRemainingColumn(), Speed(), refresh_per_second=10) as bars:
        task = bars.add_task("train", total=steps)
        for _ in range(steps):
            time.sleep(step_s)
            bars.update(task, advance=1)


def rich_lines(steps, step_s):
    import warnings

    from rich.progress import Progress

    with Progress(refresh_per_second=10) as bars:
        task = bars.add_task("train", total=steps)
        for i in range(steps):
            time.sleep(step_s)
            if i == steps // 2:
                print("long line rank=%d %s" % (RANK, "x" * 140), flush=True)
                warnings.warn("under the bar %s" % ("w" * 120))
            bars.update(task, advance=1)


def own(steps, step_s):
    for i in range(1, steps + 1):
        time.sleep(step_s)
        print("progress: %d/%d" % (i, steps), flush=True)


def flood(n, prefix=None):
    if prefix:  # stderr itself to the file, as torchrun's redirect does: the same stream object either way
        os.dup2(os.open("%s.%d" % (prefix, RANK), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 2)
    write, flush = sys.stderr.write, sys.stderr.flush
    start = time.perf_counter()
    for i in range(n):
        write("\rupdate %d/%d" % (i + 1, n))
        flush()
    write("\n")
    flush()
    print("FLOOD rank=%d updates=%d seconds=%.4f" % (RANK, n, time.perf_counter() - start), flush=True)


def main():
    mode, args = sys.argv[1], [a if "/" in a else float(a) if "." in a else int(a) for a in sys.argv[2:]]
    {"tqdm": real_tqdm, "hand": hand, "nested": nested, "own": own, "flood": flood, "rich": rich,
     "richlines": rich_lines}[mode](*args)
    print("done rank=%d" % RANK, flush=True)


if __name__ == "__main__":
    main()
