"""A function's launch, piece by piece: what cannot be shipped is refused here; the runner writes a
rank's value only as a new private file, bounded; the agent reads it back only from a regular file,
bounded; the loop keeps each rank's value for the caller."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading

import pytest

from orchestrator.errors import UsageError
from orchestrator.node.protocol import wire
from orchestrator.node.watch.results import RESULT_LIMIT, call_results
from orchestrator.plan.call import PAYLOAD_LIMIT, Call
from orchestrator.job.events import Message

from tests.unit.fakejob import Harness


def scaled(x, by=1):
    return {"rank": int(os.environ["RANK"]), "value": x * by}


def test_what_cannot_be_pickled_or_is_too_big_is_refused_before_anything_starts():
    lock = threading.Lock()
    with pytest.raises(UsageError, match=r"<lambda> cannot be shipped to the nodes: TypeError: cannot pickle "
                                         r"'_thread.lock' object; pass what it needs as arguments that pickle"):
        Call.of(lambda: lock)
    with pytest.raises(UsageError, match=rf"scaled and its arguments are 16 MiB pickled; at most {PAYLOAD_LIMIT >> 20} MiB"):
        Call.of(scaled, (b"x" * PAYLOAD_LIMIT,))
    with pytest.raises(UsageError, match="backend='tcp': one of auto, gloo, nccl, mpi, or None"):
        Call.of(scaled, backend="tcp")


def run_rank(tmp_path, call: Call, rank: int = 3, local_rank: int = 0, torch: bool = True):
    """The runner as a rank runs it: ``-m ddp_up_call`` with the hooks on its path. ``torch``
    False: as on a node without torch (the runner goes on without torch's error file), for a test
    of what the runner itself writes, which is the same either way (an import of torch: 1.5 s of CPU)."""
    for name, text in call.hooks().items():
        (tmp_path / name).write_text(text)
    if not torch:
        (tmp_path / "torch").mkdir(exist_ok=True)
        (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('no torch on this node')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "RANK": str(rank), "LOCAL_RANK": str(local_rank)}
    return subprocess.run([sys.executable, "-m", "ddp_up_call"], env=env, capture_output=True, text=True, timeout=60)


def test_the_runner_writes_the_value_as_a_new_private_file(tmp_path):
    done = run_rank(tmp_path, Call.of(scaled, (21,), {"by": 2}, backend=None), torch=False)
    assert done.returncode == 0, done.stderr
    result = tmp_path / "result.3"
    assert pickle.loads(result.read_bytes()) == {"rank": 3, "value": 42}
    assert result.stat().st_mode & 0o777 == 0o600


FAKE_TORCH = {  # as much of torch as the runner's group uses, each call written to calls.txt
    "torch/__init__.py": "import os\n"
                         "from . import cuda\n"
                         "def device(kind, index):\n    return '%s:%d' % (kind, index)\n",
    "torch/cuda.py": "import os\n"
                     "def is_available():\n    return True\n"
                     "def set_device(d):\n    open(os.environ['CALLS'], 'a').write('set_device %s\\n' % d)\n",
    "torch/distributed.py": "import os\n"
                            "def log(text):\n    open(os.environ['CALLS'], 'a').write(text + '\\n')\n"
                            "def init_process_group(backend{}):\n    log('init %s %s' % (backend, {}))\n"
                            "def is_initialized():\n    return True\n"
                            "def barrier():\n    log('barrier')\n"
                            "def destroy_process_group():\n    log('destroy')\n",
}


@pytest.mark.parametrize("takes_device", [True, False], ids=["torch-2.3-on", "older-torch"])
def test_an_nccl_group_is_bound_to_the_ranks_gpu_where_torch_can_so_no_barrier_warns(tmp_path, monkeypatch,
                                                                                     takes_device):
    for name, text in FAKE_TORCH.items():
        if name.endswith("distributed.py"):
            text = text.format(", device_id=None", "device_id") if takes_device else text.format("", "'-'")
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.setenv("CALLS", str(tmp_path / "calls.txt"))
    done = run_rank(tmp_path, Call.of(scaled, (1,), backend="auto"), local_rank=2)
    assert done.returncode == 0, done.stderr
    bound = "cuda:2" if takes_device else "-"
    assert (tmp_path / "calls.txt").read_text().split("\n") == ["set_device cuda:2", f"init nccl {bound}", "barrier",
                                                               "destroy", ""]


def test_the_runner_never_writes_through_a_planted_name_and_fails_a_value_too_big(tmp_path):
    (tmp_path / "elsewhere").write_text("theirs")
    os.symlink(tmp_path / "elsewhere", tmp_path / "result.3")
    done = run_rank(tmp_path, Call.of(scaled, (1,), backend=None), torch=False)
    assert done.returncode != 0 and "FileExistsError" in done.stderr
    assert (tmp_path / "elsewhere").read_text() == "theirs"
    os.unlink(tmp_path / "result.3")
    done = run_rank(tmp_path, Call.of(bytes, (RESULT_LIMIT + 1,), backend=None), torch=False)
    assert done.returncode != 0 and "ResultTooLarge: rank 3's return value is" in done.stderr
    assert "save it to a file and return the path" in done.stderr and not (tmp_path / "result.3").exists()


def test_the_agent_reads_values_back_from_regular_files_only_and_bounded(tmp_path):
    (tmp_path / "result.0").write_bytes(pickle.dumps("zero"))
    os.mkfifo(tmp_path / "result.1")  # a FIFO would hold a blocking reader forever
    (tmp_path / "real").write_bytes(b"x")
    os.symlink(tmp_path / "real", tmp_path / "result.2")
    (tmp_path / "result.3").write_bytes(b"x" * (RESULT_LIMIT + 1))
    (tmp_path / "result.9").write_bytes(b"more than this node's ranks")
    (tmp_path / "notes.txt").write_text("not a result")
    frames = call_results(str(tmp_path), nproc=4)
    assert [(f.rank, f.problem, f.data) for f in frames] == [
        (0, None, pickle.dumps("zero")), (1, "its result is not a regular file", b""),
        (2, "its result is not a regular file", b""), (3, f"its result is over {RESULT_LIMIT >> 20} MiB", b"")]


def test_the_loop_keeps_each_ranks_value_and_refuses_one_for_a_rank_not_the_nodes():
    h = Harness(2)
    h.job.status[0].state = h.job.status[1].state = "running"
    h.job.events.put(Message(0, wire.Result(rank=0, problem=None, data=b"v0")))
    h.job.events.put(Message(1, wire.Result(rank=1, problem="its result is over 8 MiB", data=b"")))
    h.job.events.put(Message(1, wire.Result(rank=0, problem=None, data=b"not node 1's rank")))
    for _ in range(3):
        h.job.turn(None)
    assert h.job.result().values == {0: b"v0", 1: "its result is over 8 MiB"}
    assert h.job.status[1].state == "lost" and "unexpected Result" in h.job.status[1].reason


class Unprintable(Exception):
    def __str__(self):
        raise ValueError("str() of this exception fails")


def raises_unprintable():
    raise Unprintable()


def test_an_exception_whose_str_raises_is_recorded_as_its_own_class(tmp_path):
    """torch's `record` formats the exception for its error file; a str() that raises replaced the
    rank's exception with the formatter's own, and the root cause named the wrong class."""
    error_file = tmp_path / "error.json"
    for name, text in Call.of(raises_unprintable, backend=None).hooks().items():
        (tmp_path / name).write_text(text)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.path.dirname(__file__)}", "RANK": "0",
           "LOCAL_RANK": "0", "TORCHELASTIC_ERROR_FILE": str(error_file)}
    done = subprocess.run([sys.executable, "-m", "ddp_up_call"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    import json

    message = json.loads(error_file.read_text())["message"]
    assert message["message"] == "Unprintable: <str() failed>", message
    assert "raises_unprintable" in message["extraInfo"]["py_callstack"]  # the rank's own frames
