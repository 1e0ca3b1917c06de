"""The state root against planted and damaged files (a FIFO, a huge record, a linked node folder):
every file the agent reads there is a regular file opened without blocking and read bounded; a bad
record is named and passed over, and the node's other jobs are still listed."""

from __future__ import annotations

import ast
import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from orchestrator.commands.attach import main_ls
from orchestrator.node.local import inventory, state
from orchestrator.node.supervise import replay
from orchestrator.node.protocol import wire

NODE = Path(state.__file__).parents[1]  # the node package, every room
JOB = "20261127-010000-aaaaaa"


def record(job: str) -> dict:
    return {"job": job, "node": 0, "state": "done", "pid": 1, "started": time.time() - 5, "ended": time.time(),
            "code": 0, "retention": 1e9, "attempt": 0, "label": "a", "script": "train.py"}


@pytest.fixture
def root(tmp_path, monkeypatch) -> Path:
    monkeypatch.setattr(state.tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # a local agent's state root is the same
    return Path(state.state_root())


def job_dir(root: Path, job: str, text: str | bytes | None = None) -> Path:
    where, _ = state.claim_node_dir(job, 0)
    if text is not None:
        Path(where, state.RECORD).write_bytes(text if isinstance(text, bytes) else text.encode())
    return Path(where)


def bounded(call, limit: float = 20.0):
    """``call()`` on a thread, waited for at most ``limit`` s: a blocked open fails the test, not the run."""
    out: list = []
    worker = threading.Thread(target=lambda: out.append(call()), daemon=True)
    worker.start()
    worker.join(limit)
    assert out, f"{call} did not return within {limit} s (blocked on a planted file?)"
    return out[0]


def test_a_fifo_as_a_record_or_a_journal_is_named_and_blocks_nothing(root):
    job_dir(root, "good", json.dumps(record("good")))
    os.mkfifo(job_dir(root, JOB) / state.RECORD)
    listed, skipped = bounded(inventory.recorded_jobs)
    assert [r["job"] for _, r in listed] == ["good"]
    assert skipped == [f"{root}/{JOB}/node0/{state.RECORD}: not a regular file"]
    os.mkfifo(job_dir(root, "other", json.dumps(record("other"))) / state.JOURNAL)
    sent = []
    writer = type("W", (), {"send": lambda self, f, block=True: sent.append(f), "drain": lambda self, t: None,
                            "broken": False})()
    spec = wire.FollowSpec(job="other", node=0, attempt=0, follow=True, tail=None, heartbeat=5.0)
    bounded(lambda: replay.follow(spec, writer))
    assert [type(f).__name__ for f in sent] == ["Failed"] and "job other's journal on this node cannot be read (not a regular file)" in sent[0].what


def test_a_huge_record_is_not_read_whole_and_hides_no_other_job(root):
    job_dir(root, "good", json.dumps(record("good")))
    job_dir(root, "huge", json.dumps(dict(record("huge"), script="x" * (3 << 20))))
    listed, skipped = inventory.recorded_jobs()
    assert [r["job"] for _, r in listed] == ["good"]
    assert skipped == [f"{root}/huge/node0/{state.RECORD}: larger than 1 MiB"]


def test_a_linked_node_folder_is_never_listed_or_swept(root, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (elsewhere / state.RECORD).write_text(json.dumps(record("linked")))
    job_dir(root, "linked")
    os.rmdir(root / "linked" / "node0")
    os.symlink(elsewhere, root / "linked" / "node0")
    assert inventory.recorded_jobs() == ([], [])
    assert inventory.remove_stale_state({}, purge=True) == [] and (elsewhere / state.RECORD).exists()
    assert state.job_node_dir("linked", 0) is None


def test_ddp_ls_names_a_planted_record_lists_the_rest_and_advises_no_version_change(root, tmp_path, capsys):
    job_dir(root, "good", json.dumps(record("good")))
    job_dir(root, "huge", b"[" * (5 << 20))
    os.mkfifo(job_dir(root, JOB) / state.RECORD)
    cluster = tmp_path / "c.yaml"
    cluster.write_text(f"transport: local\npython: {sys.executable}\nnodes: [{{host: a, gpus: 1}}]\n")
    assert bounded(lambda: main_ls([str(cluster)]), 60) == 0
    out = capsys.readouterr().out
    assert "good" in out and "no detached jobs" not in out and "version" not in out
    assert f"a: passed over {root}/huge/node0/{state.RECORD}: larger than 1 MiB" in out.replace("\n", "")
    assert f"{JOB}/node0/{state.RECORD}: not a regular file" in out.replace("\n", "")


def os_open_calls(path: Path) -> list[tuple[str, str]]:
    """(the enclosing function, the flags' source) of every os.open and open() call in a module."""
    tree = ast.parse(path.read_text())
    found = []
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef):
            for call in ast.walk(fn):
                if isinstance(call, ast.Call) and (
                        (isinstance(call.func, ast.Attribute) and call.func.attr == "open"
                         and isinstance(call.func.value, ast.Name) and call.func.value.id == "os")
                        or (isinstance(call.func, ast.Name) and call.func.id == "open")):
                    found.append((fn.name, ast.unparse(call)))
    return found


def test_every_read_in_a_folder_others_can_write_goes_through_one_helper():
    """The agent's modules that touch the state root or a job's folders open files to read only
    through state.open_regular (regular files, no link, no blocking); other reads are of /proc,
    of the user's own tree (fetch and sync, with their own checks), or writes of new files."""
    allowed_reads = {("state", "open_regular"), ("fetch", "send_one"), ("sync", "send_file"),
                     ("state", "private_dir"), ("ourcode", "source_of"),  # (ddp-up's own module's file)
                     ("inchild", "become"),  # (in a warm rank: the sitecustomize a cold start's site would import)
                     ("inchild", "run_script"),  # (in a warm rank: its script, which a cold start's python opens too)
                     ("rankhook", "_ddp_up_stack_dumps"),  # (the hook's own flag: regular, no link, no blocking)
                     ("warm", "show_imports_output"),  # (its own log, in the attempt's private folder: no link, no blocking)
                     ("torchprobe", "torch_info")}  # (torch's own version.py, where the job's Python finds torch)
    for module in sorted(NODE.rglob("*.py")):
        for function, call in os_open_calls(module):
            reading = "O_RDONLY" in call or call.startswith("open(") and "'w" not in call and '"w' not in call \
                and '"a' not in call and "'a" not in call
            if not reading or "/proc" in call or '"/proc' in call or "os.devnull" in call:
                continue
            assert (module.stem, function) in allowed_reads, f"{module.name}: {function}: {call}"


def test_ddp_logs_with_no_journal_readable_exits_3_and_speaks_as_itself(root, tmp_path, capsys, monkeypatch):
    """Each node keeps the job's record, and a FIFO where its journal goes."""
    from orchestrator.commands.attach import main_logs

    monkeypatch.chdir(tmp_path)  # its runs/ here, not in the checkout
    for node in (0, 1):
        where, _ = state.claim_node_dir(JOB, node)
        Path(where, state.RECORD).write_text(json.dumps(dict(record(JOB), node=node)))
        os.mkfifo(Path(where, state.JOURNAL))
    cluster = tmp_path / "c.yaml"
    cluster.write_text(f"transport: local\npython: {sys.executable}\nnodes: [{{host: a, gpus: 1}}, {{host: b, gpus: 1}}]\n")
    assert bounded(lambda: main_logs([str(cluster), JOB]), 60) == 3
    out = " ".join(capsys.readouterr().out.split())
    for host in ("a", "b"):
        assert f"ddp-logs {host}: job {JOB}'s journal on this node cannot be read (not a regular file)" in out
    assert "ddp-up" not in out
