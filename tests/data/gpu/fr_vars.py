"""Which buffer variable this torch's NCCL Flight Recorder reads (capture.sh): one rank, one
all_reduce, then the number of entries each dump holds. Run once per variable."""
import json
import os

import torch
import torch.distributed as dist

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29611"), RANK="0", WORLD_SIZE="1")
torch.cuda.set_device(0)
dist.init_process_group("nccl")
t = torch.ones(8, device="cuda")
dist.all_reduce(t)
torch.cuda.synchronize()
c10d = torch._C._distributed_c10d
counts = {}
for name in ("_dump_nccl_trace_json", "_dump_fr_trace_json"):
    if hasattr(c10d, name):
        try:
            counts[name] = len(json.loads(getattr(c10d, name)(True, False)).get("entries", []))
        except Exception as e:  # noqa: BLE001 - report, whatever it is
            counts[name] = repr(e)[:200]
print(json.dumps(dict(vars={k: v for k, v in os.environ.items() if "BUFFER" in k}, entries=counts)))
dist.destroy_process_group()
