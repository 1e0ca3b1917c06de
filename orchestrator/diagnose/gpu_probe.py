"""ddp-check --gpus's program: run on the nodes by ddp-up's own launcher, one process per GPU.

Never imported by the controller (it needs torch): ddp-check ships its text in the run spec, each
agent writes it into the node's private state directory, and the launcher runs it with -m. Every
rank measures its own GPU (LOCAL_RANK of the job's GPUs) at the same time as all the others, with
no collective between them, and prints one line, ``DDP_UP_GPU <json>``, which says whether the
rank was forked from the node's warm interpreter (torch imported before it began):
- matmul TFLOPs: an n x n matmul in bf16, or fp32 where the GPU has no bf16;
- device copy GB/s: bytes read plus bytes written by a device-to-device copy;
- host-to-device GB/s: a copy from pinned host memory.

Each figure is the best of a few rounds (noise only ever slows a round down), and a round is as
many calls as fill about ROUND_SECONDS, so a slow GPU takes no longer to measure than a fast one.
The buffers are a few hundred MiB in all: enough to stream past the largest L2 cache (50 MiB),
little enough to fit beside another job's leftovers.
"""

import json
import os
import sys
import time

MATMUL_N = 8192
COPY_BYTES = 256 << 20
H2D_BYTES = 256 << 20
ROUNDS = 5
ROUND_SECONDS = 0.02
MAX_CALLS = 50
REPORT = "DDP_UP_GPU "
WARM = "torch" in sys.modules  # imported before this module ran: forked from the node's warm interpreter


def calls_per_round(one_call):
    """How many calls make a round of about ROUND_SECONDS, from one timed call's seconds."""
    if one_call <= 0:
        return MAX_CALLS
    return max(1, min(MAX_CALLS, int(ROUND_SECONDS / one_call)))


def best_rate(work, calls, round_seconds):
    """Work per second of the fastest round: ``work`` done by one call, ``calls`` a round."""
    fastest = min(round_seconds)
    return work * calls / fastest if fastest > 0 else 0.0


def measure(fn, work, sync):
    """The best rate of ``fn``: one warm-up call, one timed call to size the rounds, then ROUNDS."""
    fn()
    sync()
    start = time.perf_counter()
    fn()
    sync()
    calls = calls_per_round(time.perf_counter() - start)
    rounds = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        rounds.append(time.perf_counter() - start)
    return best_rate(work, calls, rounds)


def device_facts(torch, index):
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    return {"name": props.name, "uuid": ("GPU-%s" % uuid) if uuid is not None else None,
            "memory_gib": round(props.total_memory / 2 ** 30, 1)}


def matmul_rate(torch, device, dtype, sync):
    """FLOPs a second of an n x n matmul; its buffers are freed on return, before the copies'."""
    a = torch.randn(MATMUL_N, MATMUL_N, device=device, dtype=dtype)
    b = torch.randn(MATMUL_N, MATMUL_N, device=device, dtype=dtype)
    c = torch.empty_like(a)
    return measure(lambda: torch.matmul(a, b, out=c), 2 * MATMUL_N ** 3, sync)


def measure_gpu(torch, index):
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)

    def sync():
        torch.cuda.synchronize(device)

    dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    tflops = matmul_rate(torch, device, dtype, sync) / 1e12
    x = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    copy = measure(lambda: y.copy_(x), 2 * COPY_BYTES, sync) / 1e9
    host = torch.empty(H2D_BYTES, dtype=torch.uint8, pin_memory=True)
    h2d = measure(lambda: y.copy_(host, non_blocking=True), H2D_BYTES, sync) / 1e9
    return {"dtype": str(dtype).split(".")[-1], "tflops": round(tflops, 1), "copy_gbs": round(copy, 1),
            "h2d_gbs": round(h2d, 1), "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2 ** 30, 2)}


def main():
    local = int(os.environ.get("LOCAL_RANK", "0"))
    report = {"rank": int(os.environ.get("RANK", "0")), "local_rank": local, "warm": WARM}
    started = time.perf_counter()
    if not os.path.isdir("/proc/driver/nvidia/gpus"):  # said before torch's import, which takes seconds
        report["error"] = "no NVIDIA GPU on this node"
        report["no_gpu"] = True
        print(REPORT + json.dumps(report), flush=True)
        os._exit(0)
    try:
        import torch
    except ImportError as e:
        report["error"] = "torch does not import here: %s" % e
    else:
        if not torch.cuda.is_available():
            report["error"] = "torch %s here sees no CUDA device" % torch.__version__
        elif local >= torch.cuda.device_count():
            report["error"] = "LOCAL_RANK %d but torch sees %d GPU(s)" % (local, torch.cuda.device_count())
        else:
            report.update(device_facts(torch, local))
            report.update(measure_gpu(torch, local))
    report["seconds"] = round(time.perf_counter() - started, 3)
    print(REPORT + json.dumps(report), flush=True)
    sys.stdout.flush()
    os._exit(0)  # everything is said; CUDA's teardown adds nothing


if __name__ == "__main__":
    main()
