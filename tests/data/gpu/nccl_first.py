"""A rank that times its own start (capture.sh warm): seconds from its process's start to torch
imported and to its first NCCL all_reduce on its GPU (gloo on a CPU, to try the script there),
and whether torch was there before it began (forked from the node's warm interpreter). An
argument N: attempt N raises after the all_reduce, so that a restart's next attempt is checked
to use CUDA and NCCL too."""
import os
import sys
import time

WARM = "torch" in sys.modules


def since_start():
    # the process's start from /proc (clock ticks after boot), against the clock of /proc/uptime
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return uptime - ticks / os.sysconf("SC_CLK_TCK")


import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

torch_ready = since_start()
local = int(os.environ.get("LOCAL_RANK", "0"))
if torch.cuda.is_available():
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
else:
    dist.init_process_group("gloo")
x = torch.ones(1, device="cuda" if torch.cuda.is_available() else "cpu")
dist.all_reduce(x)
x = x.cpu()
attempt = os.environ.get("DDP_UP_ATTEMPT", "0")
print("NCCL_FIRST rank %d backend %s attempt %s warm %s torch_ready %.2fs first_all_reduce %.2fs value %s"
      % (dist.get_rank(), dist.get_backend(), attempt, WARM, torch_ready, since_start(), x.item()), flush=True)
if sys.argv[1:2] == [attempt]:
    raise RuntimeError("planted failure in attempt %s, after CUDA and NCCL worked" % attempt)
dist.destroy_process_group()
print("NCCL_DONE local rank %d %.2fs" % (local, since_start()), flush=True)
