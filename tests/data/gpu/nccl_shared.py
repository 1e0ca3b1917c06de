"""Two ranks on one GPU (capture.sh): does NCCL allow it? Every rank uses cuda:0."""
import datetime
import os

import torch
import torch.distributed as dist

torch.cuda.set_device(0)
dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=60))
t = torch.full((4,), float(dist.get_rank() + 1), device="cuda")
dist.all_reduce(t)
print("rank %d: all_reduce on a shared GPU gave %s" % (dist.get_rank(), t.tolist()), flush=True)
dist.destroy_process_group()
