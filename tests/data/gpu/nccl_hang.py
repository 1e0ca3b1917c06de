"""A job that hangs on purpose inside an NCCL collective (capture.sh): a spinning kernel holds the
stream, so the all_reduce queued after it never completes, and the rank goes silent. With
DDP_UP_CAPTURE set, the rank also writes torch's own Flight Recorder dumps there."""
import datetime
import os
import time

import torch
import torch.distributed as dist

local = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local)
dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=600))
t = torch.ones(1024, device="cuda")
for step in range(3):
    dist.all_reduce(t)
torch.cuda.synchronize()
print("rank %d: 3 all_reduces done; now stuck behind a spinning kernel" % dist.get_rank(), flush=True)
torch.cuda._sleep(1 << 40)  # ~10 min of GPU cycles on the current stream
work = dist.all_reduce(t, async_op=True)
out = os.environ.get("DDP_UP_CAPTURE")
if out:
    time.sleep(8)
    c10d = torch._C._distributed_c10d
    for name in ("_dump_nccl_trace_json", "_dump_fr_trace_json"):
        if hasattr(c10d, name):
            data = getattr(c10d, name)(True, False)
            with open(os.path.join(out, "%s.rank%d.json" % (name.strip("_"), dist.get_rank())), "w") as f:
                f.write(data if isinstance(data, str) else data.decode())
while True:
    time.sleep(1)
