"""What a new user meets in the first hour, on real torchrun jobs (`transport: local` nodes: the
same agent, relay and controller path as over SSH): the rank's exception in the root cause
without torchelastic's @record, and no warning that ddp-up itself caused."""

from __future__ import annotations

import json
import re

import pytest

from tests.harness import procs
from tests.harness.runner import ddp_up, local_cluster, run_dir
from tests.integration.conftest import SCRIPT, needs


def job_of(out: str) -> str:
    return re.search(r"job (\d{8}-\d{6}-\w+)", out).group(1)


def test_a_rank_that_raises_without_record_is_the_root_cause_with_its_exception(tmp_path):
    """Rank 1 raises after init_process_group, as most scripts do: no @record, no handler. torch
    prints its traceback as "[rank1]: ..." lines; its peers' barriers fail with gloo's "Connection
    closed by peer" a moment later, and their logs may be written first."""
    path = local_cluster(tmp_path, nodes=2, gpus=2)
    code, out, _ = ddp_up("--no-dashboard", str(path), SCRIPT, "run", "--raise-plain", "1")
    assert code == 1, out
    assert re.search(r"^root cause: local-0 \(node 0, rank 1\): rank 1 exited with code 1: RuntimeError: boom from "
                     r"rank 1$", out, re.M), out
    job = job_of(out)
    summary = json.loads((run_dir(job) / "summary.json").read_text())
    assert summary["root_cause"]["exception"] == "RuntimeError: boom from rank 1", summary["root_cause"]
    assert summary["root_cause"]["traceback"][-1] == "RuntimeError: boom from rank 1"
    assert procs.wait_no_job_processes(job, 15) == []


def test_a_plain_run_prints_no_warning_that_ddp_up_caused(tmp_path):
    """The Flight Recorder's buffer is set under the one name the node's torch reads: both names
    made torch print a deprecation warning in every rank."""
    path = local_cluster(tmp_path, nodes=2, gpus=1)
    code, out, _ = ddp_up("--no-dashboard", str(path), SCRIPT, "run", "--steps", "1")
    assert code == 0, out
    assert not re.search(r"warn|deprecat", out, re.I), out
    assert procs.wait_no_job_processes(job_of(out), 15) == []


@pytest.mark.long
def test_a_slow_start_is_no_hang_and_a_rank_that_never_starts_is_named(tmp_path):
    """Rank 1 takes 8 s before init_process_group (a loaded node importing torch from NFS), with
    hang_timeout 4: the job runs, since each rank's hang clock starts when its process group is
    up or at its first line. Then rank 1 never gets there: start-up's own limit names it, and rank
    0, which waits for it inside init_process_group, is not blamed. Without a launcher: the subject
    is the hang clock, and torchrun's own exit after its last rank's (its exit barrier, a second or
    more on a loaded machine) is silence that a 4 s hang_timeout once counted as a hang."""
    env = {"OMP_NUM_THREADS": 1, "JOB_SLOW_RANK": 1, "JOB_INIT_DELAY": 8}
    path = local_cluster(tmp_path, nodes=2, gpus=1, hang_timeout=4, launcher="none", env=env)
    code, out, _ = ddp_up("--no-dashboard", str(path), SCRIPT, "run", "--steps", "1")
    assert code == 0 and "looks hung" not in out, out
    # 30 s: rank 0 must be in init by then; 12 s was once too short for its import of torch on a
    # loaded 2-core machine (both ranks were named, rightly: neither had reached it)
    path = local_cluster(tmp_path, nodes=2, gpus=1, hang_timeout=4, startup_timeout=30, launcher="none",
                         env=dict(env, JOB_INIT_DELAY=300))
    code, out, _ = ddp_up("--no-dashboard", str(path), SCRIPT, "run", "--steps", "1")
    assert code == 1, out
    assert re.search(r"^root cause: local-1 \(node 1, rank 1\): job did not start: rank 1 has not reached "
                     r"init_process_group after \d+ s \(its stack is in init\); rank 0 waits for it in \S+ \(from "
                     r"init\); stacks in", out, re.M), out
    assert procs.wait_no_job_processes(job_of(out), 15) == []


@pytest.mark.parametrize("launcher, local_rank", [("torchrun", []), ("legacy", ["--local_rank=0"]), ("none", [])])
def test_a_module_target_runs_under_every_launcher(tmp_path, launcher, local_rank):
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "train.py").write_text(
        "import json, os, sys\nprint('MODULE', os.environ['RANK'], json.dumps(sys.argv[1:]), flush=True)\n")
    path = local_cluster(tmp_path, nodes=2, gpus=1, launcher=launcher)
    code, out, _ = ddp_up("--no-dashboard", str(path), "-m", "mypkg.train", "--lr", "0.1")
    assert code == 0, out
    for rank, node in ((0, "local-0"), (1, "local-1")):
        assert re.search(rf"^{node} r{rank} \| MODULE {rank} (.*)$", out, re.M), out
        args = re.search(rf"^{node} r{rank} \| MODULE {rank} (.*)$", out, re.M).group(1)
        assert json.loads(args) == [*local_rank, "--lr", "0.1"]


ACCELERATE_SCRIPT = """
import os, torch
from accelerate import Accelerator

acc = Accelerator()
total = acc.reduce(torch.tensor([float(acc.process_index + 1)], device=acc.device), reduction="sum")
print(f"ACC rank={acc.process_index} of {acc.num_processes} {acc.distributed_type.value} sum={total.item():.0f}", flush=True)
if torch.distributed.is_initialized():  # under torchrun too: Accelerate starts a group though each rank trains alone
    torch.distributed.barrier()  # no rank leaves before every rank has joined: gloo fails a peer still connecting
    torch.distributed.destroy_process_group()
os._exit(0)  # torch 2.13 + gloo can abort in the interpreter's teardown (SIGABRT)
"""


def test_launcher_accelerate_runs_one_job_across_the_nodes_and_torchrun_says_what_cpu_needs(tmp_path):
    """`accelerate launch` with ddp-up's machine rank, machines, main process address and port:
    one job of 4 ranks on CPU (ACCELERATE_USE_CPU set for nodes without GPUs). Under torchrun the
    same script would train alone in every rank: a notice says so before it starts."""
    needs("accelerate")
    (tmp_path / "acc.py").write_text(ACCELERATE_SCRIPT)
    path = local_cluster(tmp_path, nodes=2, gpus=2, launcher="accelerate")
    code, out, _ = ddp_up("--no-dashboard", str(path), "acc.py")
    assert code == 0, out
    for rank, node in ((0, "local-0"), (1, "local-0"), (2, "local-1"), (3, "local-1")):
        assert re.search(rf"^{node} r{rank} \| ACC rank={rank} of 4 MULTI_CPU sum=10$", out, re.M), out
    path = local_cluster(tmp_path, nodes=2, gpus=1, launcher="torchrun")
    code, out, _ = ddp_up("--no-dashboard", str(path), str(tmp_path / "acc.py"))  # readable here too: read
    assert code == 0 and "ACC rank=0 of 1 NO sum=1" in out, out
    assert f"{tmp_path / 'acc.py'} uses Accelerate and these nodes have no GPU: without ACCELERATE_USE_CPU=1 in `env:` each " \
           "rank trains alone" in out
