"""The agent's kill path on real processes (no torch): only tagged processes, node-scoped."""

import os
import signal
import subprocess
import sys

import pytest

from orchestrator.node.attempt import checks
from orchestrator.node.probes import facts
from orchestrator.node.local.procs import find_tagged, is_launcher, kill_tagged, signal_tagged

SLEEPER = "import signal, sys, time\nif 'ignore' in sys.argv: signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" \
          "print('up', flush=True)\ntime.sleep(60)\n"


@pytest.fixture
def spawn():
    started = []

    def make(tags: dict, *extra: str) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DDP_UP_")}
        p = subprocess.Popen([sys.executable, "-c", SLEEPER, *extra], env={**env, **tags}, stdout=subprocess.PIPE)
        assert p.stdout.readline() == b"up\n"  # running, handler installed
        started.append(p)
        return p

    yield make
    for p in started:
        p.kill()
        p.wait(5)


def tags(job: str, node: int) -> dict:
    return {"DDP_UP_JOB": job, "DDP_UP_NODE": str(node), "DDP_UP_CLUSTER": "c1"}


def test_kills_exactly_the_tagged_node(spawn):
    mine = spawn(tags("jobA", 0))
    sibling = spawn(tags("jobA", 1))  # same job, other node sharing this process table
    other_job = spawn(tags("jobB", 0))
    decoy = spawn({})
    result = kill_tagged({"DDP_UP_JOB": "jobA", "DDP_UP_NODE": "0"}, grace=5)
    assert [p["pid"] for p in result["found"]] == [mine.pid]
    assert mine.wait(5) == -signal.SIGTERM
    assert result["killed"] == [] and result["left"] == []
    assert sibling.poll() is None and other_job.poll() is None and decoy.poll() is None


def test_sigterm_ignored_means_sigkill_after_grace(spawn):
    stubborn = spawn(tags("jobC", 0), "ignore")
    result = kill_tagged({"DDP_UP_JOB": "jobC"}, grace=0.3)
    assert result["killed"] == [stubborn.pid]
    assert stubborn.wait(5) == -signal.SIGKILL


def test_signal_refuses_a_process_without_the_tags(spawn):
    decoy = spawn({})
    assert not signal_tagged(decoy.pid, signal.SIGKILL, {"DDP_UP_JOB": "jobA"})
    assert decoy.poll() is None


def test_what_a_stop_cut_short_counts_the_ranks_not_a_launcher_still_tearing_itself_down():
    """At the end of stop_grace the agent kills what is left; torchrun, slow to exit after its own
    SIGKILLs (counted from its log), is not "a save that took longer"."""
    found = [{"pid": 1, "cmd": "python3 -u -m torch.distributed.run --nnodes=2 train.py"},
             {"pid": 2, "cmd": "python3 -u train.py --epochs 3"}]
    assert [p["pid"] for p in found if not is_launcher(p)] == [2]


def test_find_matches_cluster_tag(spawn):
    p = spawn(tags("jobD", 3))
    assert [x["pid"] for x in find_tagged({"DDP_UP_CLUSTER": "c1", "DDP_UP_JOB": "jobD"})] == [p.pid]
    assert find_tagged({"DDP_UP_CLUSTER": "other", "DDP_UP_JOB": "jobD"}) == []


@pytest.mark.parametrize("visible,count", [("0,1,2", 3), ("GPU-5f2a", 1), ("", 0), ("1,-1,2", 1), ("-1", 0),
                                           (" 0 , 1 ", 2)])
def test_gpu_count_follows_cuda_visible_devices(visible, count):
    assert facts.count_gpus({"CUDA_VISIBLE_DEVICES": visible}) == count


def test_the_held_master_port_answers_any_number_of_probes_then_is_free_at_once():
    """128 nodes probing the master once filled the listen backlog of a port nothing accepted on."""
    import socket

    held = checks.PortHold(0)
    port = held.port
    for _ in range(300):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    held.close()
    assert not held.answering.is_alive()
    again = socket.socket()
    try:  # what torchrun's store does next (with SO_REUSEADDR, as c10d sets it): only a listener would refuse
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("", port))
        again.listen()
    finally:
        again.close()


def test_ddp_kills_note_tells_its_signal_from_anyone_elses_once(tmp_path, monkeypatch):
    """Issue 27, item 5: an agent stopped by ddp-kill ends the run; one stopped by anyone else's
    signal (Slurm, a shutdown) is a stop from outside. The note is per agent pid, in the private
    state root, taken once; a state root that is not private gets none."""
    import tempfile

    from orchestrator.node.local import state
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert state.private_dir(state.state_root()) is None
    assert state.killed_by_ddp_kill() is False  # nobody's note: anyone's signal
    path = state.note_kill(os.getpid())
    assert path == os.path.join(state.state_root(), f"kill.{os.getpid()}") and oct(os.stat(path).st_mode & 0o777) == "0o600"
    assert state.note_kill(os.getpid()) == path  # a second ddp-kill: the same note
    assert state.killed_by_ddp_kill() is True and state.killed_by_ddp_kill() is False
    os.chmod(state.state_root(), 0o777)
    assert state.note_kill(os.getpid()) is None and state.killed_by_ddp_kill() is False


def test_an_agent_is_known_by_its_name_and_one_of_an_earlier_version_by_its_old_mark():
    """ddp-kill stops a detached job's agents first: this version's, named in ps, and those of a job
    started before an upgrade, whose command line began with the loader's mark."""
    from orchestrator.node.local.procs import is_agent

    assert is_agent({"cmd": "ddp-up-agent job=20261128-000000-abcdef node=1"})
    assert is_agent({"cmd": "/usr/bin/python3 -u -S -c 'ddp_up_agent';import sys,types,marshal;i=sys.stdin.buffer"})
    assert not is_agent({"cmd": "/usr/bin/python3 -u train.py --agent ddp-up"})
