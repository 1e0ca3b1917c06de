"""orchestrator.launch three times in one Python session (capture.sh warm): a function that uses
CUDA and NCCL, on the cluster file given. For each launch, seconds from launch() called to: the
rank's process started (forked), its group ready (the function called), its all_reduce done, and
launch() returned. Local nodes only: the rank's clock is this process's."""
import os
import sys
import time

from orchestrator import launch


def on_gpu():
    import torch
    import torch.distributed as dist

    def started():  # the process's start, on the wall clock (/proc: clock ticks after boot)
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")

    called = time.time()
    x = torch.full((1,), float(dist.get_rank() + 1), device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(x)
    return {"backend": dist.get_backend(), "sum": x.item(), "started": started(), "called": called,
            "reduced": time.time()}


for n in (1, 2, 3):
    began = time.time()
    run = launch(sys.argv[1], on_gpu, runs_dir=sys.argv[2])
    ended = time.time()
    r = run.results[0]
    print("LAUNCH %d took %.2f s exit %d %s: forked +%.2f, group ready +%.2f, all_reduce done +%.2f, returned +%.2f"
          % (n, ended - began, run.exit_code, r["backend"], r["started"] - began, r["called"] - began,
             r["reduced"] - began, ended - began), flush=True)
