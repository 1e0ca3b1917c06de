"""A job for the container tests (issue 30), run inside the test image by torchrun.

    boxed.py DIR MODE

Every rank joins a gloo group, checks the job's secret reached it (printing only whether it
did), writes DIR/ready.<attempt>.<rank> (the start of the warm interpreter it was forked from, in
clock ticks since boot, or "cold") and then, by MODE:
  wait     waits for DIR/go (bounded), all-reduces, and exits 0
  hold     runs until stopped: SIGTERM is saved on ("saved on SIGTERM")
  stubborn like hold, but rank 0 and 1 ignore SIGTERM, and the last rank fails with exit 7
  retry    attempt 0: rank 0 fails with exit 3; a later attempt all-reduces and exits 0
"""

import os
import signal
import sys
import time

WARM = "torch" in sys.modules  # imported before this script began: forked from a warm interpreter (node/launchers/boxwarm.py)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

where, mode = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
attempt = int(os.environ.get("DDP_UP_ATTEMPT", "0"))
boxed = any(os.path.exists(p) for p in ("/run/.containerenv", "/.dockerenv"))  # podman's, docker's
print("rank %d token %s uid %d in %s%s" % (rank, "ok" if os.environ.get("BOX_TOKEN") == "s3cr3t-value-42" else "MISSING",
                                           os.getuid(), os.getcwd(), " (a container)" if boxed else ""), flush=True)
print("rank %d warm %s attempt %d" % (rank, WARM, attempt), flush=True)
interpreter = "cold"
if WARM:  # the interpreter it was forked from, by its start (clock ticks since boot): new in a new container
    with open("/proc/%d/stat" % os.getppid()) as f:
        interpreter = f.read().rsplit(")", 1)[1].split()[19]
with open(os.path.join(where, "ready.%d.%d" % (attempt, rank)), "w") as f:
    f.write(interpreter)


def allreduce():
    t = torch.ones(1) * (rank + 1)
    dist.all_reduce(t)
    print("rank %d sum %d" % (rank, t.item()), flush=True)
    dist.destroy_process_group()


if mode == "wait":
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(where, "go")) and time.monotonic() < deadline:
        time.sleep(0.05)
    allreduce()
elif mode == "retry":
    if attempt == 0 and rank == 0:
        sys.exit(3)
    if attempt > 0:
        allreduce()
else:
    if mode == "stubborn" and rank < world - 1:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda *_: (print("rank %d saved on SIGTERM" % rank, flush=True), sys.exit(0)))
    if mode == "stubborn" and rank == world - 1:
        time.sleep(0.5)
        sys.exit(7)
    while True:
        time.sleep(0.1)
