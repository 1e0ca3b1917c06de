"""Test workload for integration tests. Modes:

  job.py run [--steps N] [--step-time S] [--fail-rank R --exit-code C [--fail-attempts A,B]] [--ignore-term]
             [--hang] [--checkpoint FILE] [--raise-rank R]   (R fails only in attempts A,B: DDP_UP_ATTEMPT;
             rank 0 keeps the last step done in FILE, and a run resumes after it, saying "resumed at step
             N"; --raise-rank: R raises RuntimeError under torchelastic's @record while every other
             rank waits in a barrier, which gloo then aborts: they raise a moment later; --raise-plain R:
             the same without @record or a handler, so that torch prints it as "[rankR]: Traceback ...";
             --kill-rank R: R kills itself with SIGKILL while every other rank waits in a barrier, whose
             connection to it then resets: they raise a moment after its death)
  job.py argv ARGS...     rank 0 prints ARGV <json of ARGS> and exits 0
  job.py hang             last rank blocks in all_reduce (block_forever), others sleep (wait_for_peers)
  job.py spam N [PREFIX]  every rank prints N lines as fast as it can (to PREFIX.<rank> if given) (no torch)
  job.py decoy            no torch, no tags: sleeps (a process ddp-kill must not touch)
  job.py env NAME...      every rank prints ENV NAME=value for each (no torch)
  job.py blob N           every rank prints "start" and one unterminated N-byte binary line, no \r (no torch)
  job.py tick N S [R C [A,B]]  every rank prints "tick i rank=r" N times, S seconds apart; rank R exits C at i=2,
                          or with C "hang" goes silent there for good (only in attempts A,B if given:
                          DDP_UP_ATTEMPT) (no torch); with $TICK_FAIL_ON, rank 0 of attempt 0 exits 3 once
                          that file exists; with $TICK_SAVE_S, a SIGTERM prints "saving rank=r attempt=a" and
                          the rank exits 143 that many seconds later
  job.py save FILE        (no torch) every rank prints its TORCH_ELASTIC_SHUTDOWN_TIMEOUT and "running"; on
                          each $SAVE_ON (SIGTERM unless set) it prints "got SIG... #n"; on the first it saves
                          for $SAVE_S seconds, writes FILE.<rank> and exits 0; "got SIGUSR1 #n" on each other SIGUSR1;
                          rank $FAIL_RANK, if set, exits 7 a second after it starts
  job.py usr1              (no torch) every rank prints "running", then "got SIGUSR1 #n" on each SIGUSR1, and
                          goes on until stopped
  job.py backlog L S DIR  every rank prints L lines, touches DIR/done.RANK, then "live t=..." every 0.5 s for S s
  job.py collectives HOW STEPS STEP_S [RANK]  every rank: STEPS steps of sleep STEP_S + all_reduce, then exits 0;
                          rank RANK (the last unless given): HOW "skip" sleeps instead of the all_reduce of step 3
                          (never entering it), "mismatch" calls all_gather there, "slow" sleeps 0.3 s more each
                          step, "crafted" prints and writes crafted Flight Recorder records and then skips;
                          "balanced": nobody differs
"""

import datetime
import io
import json
import os
import signal
import sys
import time

WARM = "torch" in sys.modules  # imported before this script began: a rank forked warm (node/launchers/warm.py)


def finish(code):
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # torch 2.13 + gloo can abort in interpreter teardown


def stamp():
    """" t=WALL" where $JOB_TIMES is set (the benchmarks: a detached job's lines are replayed to an
    attach that starts late, so they time the job by when its lines were printed), else nothing."""
    return f" t={time.time():.3f}" if os.environ.get("JOB_TIMES") else ""


def init():
    import torch
    import torch.distributed as dist

    # keeps peers waiting in rendezvous: every rank, or only JOB_SLOW_RANK's (a slow import, a stuck data load)
    if os.environ.get("JOB_SLOW_RANK", os.environ.get("RANK")) == os.environ.get("RANK"):
        time.sleep(float(os.environ.get("JOB_INIT_DELAY", "0")))
    # 60 s unless told: at 64 ranks on 2 cores the last rank can finish importing torch a minute late
    timeout = float(os.environ.get("JOB_PG_TIMEOUT", "60"))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    assert t.item() == world * (world + 1) / 2, t.item()
    print(f"READY rank={rank} world={world} host={os.uname().nodename} pid={os.getpid()} ppid={os.getppid()} warm={WARM} "
          f"attempt={os.environ.get('DDP_UP_ATTEMPT', '-')}{stamp()}", flush=True)
    return dist, rank


def block_forever(dist):
    import torch

    dist.all_reduce(torch.ones(1))  # the others never join: blocks until the 60 s pg timeout


def wait_for_peers():
    time.sleep(3600)


def run(argv):
    opts = {"steps": 2, "step-time": 0.0, "fail-rank": -1, "exit-code": 3, "fail-attempts": "", "checkpoint": "",
            "raise-rank": -1, "raise-plain": -1, "kill-rank": -1}
    flags = set()
    it = iter(argv)
    for a in it:
        if a in ("--ignore-term", "--hang"):
            flags.add(a)
        else:
            opts[a.lstrip("-")] = type(opts[a.lstrip("-")])(next(it))
    if "--ignore-term" in flags:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    dist, rank = init()
    attempt = os.environ.get("DDP_UP_ATTEMPT", "0")
    if rank == opts["fail-rank"] and (not opts["fail-attempts"] or attempt in opts["fail-attempts"].split(",")):
        print(f"rank {rank} failing with {opts['exit-code']}{stamp()}", file=sys.stderr, flush=True)
        finish(opts["exit-code"])
    if opts["raise-rank"] >= 0:
        raise_in(dist, rank, opts["raise-rank"])
    if opts["raise-plain"] >= 0:
        if rank == opts["raise-plain"]:
            time.sleep(0.5)  # the others are in the barrier by then
            raise RuntimeError(f"boom from rank {rank}")
        dist.barrier()  # never completes: gloo aborts it once the raising rank is gone
    if opts["kill-rank"] >= 0:
        if rank == opts["kill-rank"]:
            time.sleep(0.5)  # the others are in the barrier by then
            os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier()  # never completes: the killed rank's connections reset
    first = 0
    if opts["checkpoint"] and os.path.exists(opts["checkpoint"]):
        first = int(open(opts["checkpoint"]).read()) + 1
        print(f"resumed at step {first} rank={rank}", flush=True)
    for step in range(first, opts["steps"]):
        print(f"step {step} rank={rank}", flush=True)
        time.sleep(opts["step-time"])
        if rank == 0 and opts["checkpoint"]:
            with open(opts["checkpoint"] + ".tmp", "w") as f:
                f.write(str(step))
            os.replace(opts["checkpoint"] + ".tmp", opts["checkpoint"])
    while "--hang" in flags:
        time.sleep(1)
    dist.barrier()
    dist.destroy_process_group()
    finish(0)


def raise_in(dist, rank, raising):
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def main():
        if rank == raising:
            time.sleep(0.5)  # the others are in the barrier by then
            raise RuntimeError(f"boom from rank {rank}")
        dist.barrier()  # never completes: the raising rank is gone, and gloo aborts this one

    try:
        main()
    except Exception:
        import traceback
        traceback.print_exc()
        finish(1)


def save(prefix):
    rank, got, name = os.environ.get("RANK"), [], os.environ.get("SAVE_ON", "SIGTERM")

    def say(text):  # a signal may come while another handler prints: print() would raise "reentrant call"
        os.write(1, (text + "\n").encode())

    def on_term(signum, frame):
        first = not got  # taken now: a second signal's handler may run before the next line (Slurm sends a burst)
        got.append(signum)
        say(f"rank {rank} got {name} #{len(got)}")
        if first:
            time.sleep(float(os.environ.get("SAVE_S", "5")))
            with open(f"{prefix}.{rank}", "w") as f:
                f.write("saved\n")
            say(f"rank {rank} saved")
            finish(0)

    signal.signal(getattr(signal, name), on_term)
    if rank == os.environ.get("FAIL_RANK"):  # fail-fast: this rank fails, the others are stopped and save
        print(f"rank {rank} running", flush=True)
        time.sleep(1.0)
        finish(7)
    if name != "SIGUSR1":  # Slurm's warning before a time limit (--signal=USR1@T): it goes on
        warned = []
        signal.signal(signal.SIGUSR1, lambda *_: (warned.append(1), say(f"rank {rank} got SIGUSR1 #{len(warned)}")))
    print(f"rank {rank} SHUTDOWN_TIMEOUT={os.environ.get('TORCH_ELASTIC_SHUTDOWN_TIMEOUT')} running", flush=True)
    while True:
        time.sleep(0.2)


CRAFTED = {"entries": [
    {"is_p2p": False, "collective_seq_id": 9, "process_group": ["0", "\x1b[2J\x1b]0;pwned\x07"], "retired": False,
     "profiling_name": "gloo:\x1b[31mall_reduce\x1b[0m", "input_sizes": [[1] * 99], "input_dtypes": "Float",
     "time_created_ns": -5},
    {"is_p2p": False, "collective_seq_id": True, "process_group": ["0", "default_pg"]},
    {"is_p2p": False, "collective_seq_id": 2 ** 80, "process_group": [[[]]], "profiling_name": 7},
    ["not", "a", "dict"], None, 12]}


def collectives(how, steps, step_s, odd):
    import torch

    dist, rank = init()
    if os.environ.get("JOB_TERM_HANDLER"):  # as Lightning's: a Python handler, which runs between bytecodes only
        signal.signal(signal.SIGTERM, lambda *_: finish(143))
    flight_dir = os.environ.get("DDP_UP_FLIGHT_DIR")
    print(f"FR_BUFFER={os.environ.get('TORCH_FR_BUFFER_SIZE')} rank={rank}", flush=True)
    for step in range(steps):
        print(f"step {step} rank={rank}", flush=True)
        time.sleep(step_s + (0.3 if how == "slow" and rank == odd else 0.0))
        if rank == odd and step == 3 and how in ("skip", "crafted"):
            if how == "crafted":
                print("\x1b[2J\x1b]0;pwned\x07 " + json.dumps(CRAFTED), flush=True)
                for _ in range(30):  # over the recorder's own record, again and again
                    with open(os.path.join(flight_dir, f"fr.{rank}.json"), "w") as f:
                        json.dump(CRAFTED, f)
                    time.sleep(1)
            time.sleep(3600)  # "stuck in data loading": never enters this step's all_reduce
        if rank == odd and step == 3 and how == "mismatch":
            dist.all_gather([torch.zeros(4) for _ in range(dist.get_world_size())], torch.ones(4))
        else:
            dist.all_reduce(torch.ones(4))
    dist.barrier()
    print(f"DONE rank={rank}", flush=True)
    finish(0)


def blob(n: int) -> bytes:
    """n bytes of every value but the newline and the carriage return: C0 and C1 controls, and
    bytes that are not UTF-8 (a carriage return makes a line a progress bar, kept as it ends: issue 29)."""
    pattern = bytes(b for b in range(256) if b not in (10, 13))
    return (pattern * (n // len(pattern) + 1))[:n]


def main():
    mode, rest = sys.argv[1], sys.argv[2:]
    if os.environ.get("JOB_DECOY"):  # a worker's exact command line, without ddp-up's tags
        time.sleep(300)
        return
    if mode == "decoy":
        time.sleep(float(rest[0]) if rest else 120)
        return
    if mode == "spam":  # job.py spam N [FILE_PREFIX]: print N lines as fast as possible (no torch)
        rank = int(os.environ["RANK"])
        n, prefix = int(rest[0]), (rest[1] if len(rest) > 1 else None)
        # A file on the node, unbuffered and write-through like stdout under torchrun's `python -u`.
        out = io.TextIOWrapper(open(f"{prefix}.{rank}", "wb", buffering=0), write_through=True) if prefix \
            else sys.stdout
        line = f"rank {rank} " + "x" * 80
        t0 = time.perf_counter()
        for i in range(n):
            print(line, i, file=out)
        out.flush()
        seconds = time.perf_counter() - t0
        print(f"SPAM rank={rank} lines={n} seconds={seconds:.4f}", flush=True)
        finish(0)
    if mode == "hang":  # the last rank blocks in a collective nobody else joins; the rest wait quietly
        dist, rank = init()
        if rank == dist.get_world_size() - 1:
            block_forever(dist)
        wait_for_peers()
    if mode == "blob":  # job.py blob N: "start", then one N-byte line of every byte value but newline, unterminated
        sys.stdout.buffer.write(b"start\n" + blob(int(rest[0])))
        sys.stdout.buffer.flush()
        finish(0)
    if mode == "save":
        save(rest[0])
    if mode == "collectives":
        odd = int(rest[3]) if len(rest) > 3 else int(os.environ["WORLD_SIZE"]) - 1
        collectives(rest[0], int(rest[1]), float(rest[2]), odd)
    if mode == "usr1":
        got = []
        signal.signal(signal.SIGUSR1, lambda *_: (got.append(1), print(f"rank {os.environ.get('RANK')} got "
                                                                        f"SIGUSR1 #{len(got)}", flush=True)))
        print(f"rank {os.environ.get('RANK')} running", flush=True)
        while True:
            time.sleep(0.2)
    if mode == "env":  # job.py env NAME...: print each variable as this process sees it
        for name in rest:
            print(f"ENV {name}={os.environ.get(name, '<unset>')}", flush=True)
        finish(0)
    if mode == "tick":  # job.py tick N SECONDS [FAIL_RANK CODE [ATTEMPTS]]: N numbered lines a rank, no torch
        rank, n, pause = int(os.environ["RANK"]), int(rest[0]), float(rest[1])
        fail_rank, code = (int(rest[2]), rest[3]) if len(rest) > 3 else (-1, "0")
        if len(rest) > 4 and os.environ.get("DDP_UP_ATTEMPT", "0") not in rest[4].split(","):
            fail_rank = -1
        if os.environ.get("TICK_SAYS_PORT"):  # opt-in: a test that checks which master port each attempt had
            print(f"PORT {os.environ['MASTER_PORT']} attempt={os.environ.get('DDP_UP_ATTEMPT')}", flush=True)
        if os.environ.get("TICK_SAYS_WORLD"):  # opt-in: a test that checks each attempt's world size
            print(f"WORLD {os.environ['WORLD_SIZE']} rank={rank} attempt={os.environ.get('DDP_UP_ATTEMPT')}",
                  flush=True)
        if os.environ.get("TICK_SAVE_S"):  # opt-in: a stop's grace used, as a checkpoint's save would
            def saving(*_):
                print(f"saving rank={rank} attempt={os.environ.get('DDP_UP_ATTEMPT')}", flush=True)
                time.sleep(float(os.environ["TICK_SAVE_S"]))
                finish(143)
            signal.signal(signal.SIGTERM, saving)
        fail_on = os.environ.get("TICK_FAIL_ON")  # opt-in: rank 0 of attempt 0 exits 3 once this file exists
        fail_on = fail_on if rank == 0 and os.environ.get("DDP_UP_ATTEMPT", "0") == "0" else None
        for i in range(n):
            print(f"tick {i} rank={rank}", flush=True)
            if os.environ.get("TICK_SAYS_LOSS"):  # opt-in: a metric, as the README's demo prints it
                print(f"step {i} loss {1 / (i + 1) + rank / 100:.4f}", flush=True)
            if fail_on and os.path.exists(fail_on):  # a failure at a moment the test chooses
                print(f"rank {rank} failing with 3", file=sys.stderr, flush=True)
                finish(3)
            if rank == fail_rank and i == 2 and code == "hang":  # silent from here on: a hang
                while True:
                    time.sleep(1)
            if rank == fail_rank and i == 2:
                print(f"rank {rank} failing with {code}", file=sys.stderr, flush=True)
                finish(int(code))
            time.sleep(pause)
        finish(0)
    if mode == "backlog":  # job.py backlog LINES LIVE_SECONDS DIR: LINES lines, DIR/done.RANK, then a live line/0.5 s
        rank, lines, live, where = int(os.environ["RANK"]), int(rest[0]), float(rest[1]), rest[2]
        for i in range(lines):
            print(f"backlog {i} rank={rank} " + "x" * 60)
        sys.stdout.flush()
        open(os.path.join(where, f"done.{rank}"), "w").close()
        end = time.time() + live
        while time.time() < end:
            print(f"live t={time.time():.3f} rank={rank}", flush=True)
            time.sleep(0.5)
        finish(0)
    if mode == "argv":
        dist, rank = init()
        if rank == 0:
            print("ARGV " + json.dumps(rest), flush=True)
        dist.barrier()
        dist.destroy_process_group()
        finish(0)
    run(rest)


if __name__ == "__main__":
    main()
