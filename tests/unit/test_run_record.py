"""The run's record keeps no secret and runs nothing of the checkout's: the cluster file's copy
is made from what was parsed (a YAML escape or a folded scalar is masked too), every file is
private, git.diff holds no binary patch and no file named like a secret, and the checkout's own
fsmonitor, hooks and textconv never run. A pipe as the cluster file is read once, bounded."""

from __future__ import annotations

import json
import os
import stat
import subprocess

import pytest

from orchestrator.config import reading
from orchestrator.run import record as runrecord
from orchestrator.config.clusterfile import load_cluster
from orchestrator.errors import ConfigError

SECRET = "hf_Abcdefgh1234"
CLUSTER = f"""\
nodes: [{{host: a, gpus: 1}}]
env:
  HF_TOKEN: "hf_\\x41bcdefgh1234"     # the secret, written as a YAML escape
  NOTE: plain
  FOLDED: hf_Abcdefgh1234
forward_env: []
"""


def checkout(path):
    git = ["git", "-C", str(path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (path / "train.py").write_text("print(1)\n")
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    return git


def test_the_copy_is_what_was_parsed_masked_as_data_and_every_file_is_private(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "cluster.yaml"
    path.write_text(CLUSTER)
    config = load_cluster(str(path))
    path.write_text("nodes: [{host: changed-since, gpus: 1}]\n")  # never read again
    record = runrecord.RunRecord.take(["ddp-up", str(path), "t.py"], str(path), str(tmp_path), config.source_text)
    record.write(str(tmp_path / "runs" / "J"), config.secret_values)
    copy = (tmp_path / "runs" / "J" / "cluster.yaml").read_text()
    assert SECRET not in copy and "x41" not in copy and "HF_TOKEN: '***'" in copy and "NOTE: plain" in copy
    assert "changed-since" not in copy
    run = tmp_path / "runs" / "J"
    assert stat.S_IMODE(run.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in run.iterdir())


def test_git_diff_keeps_no_binary_patch_and_no_secret_file_and_runs_nothing_of_the_checkout(tmp_path):
    git = checkout(tmp_path)
    (tmp_path / ".gitattributes").write_text("*.py diff=text\n")
    (tmp_path / "train.py").write_text("print(2)\n")
    (tmp_path / "blob.bin").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "prod.env").write_text(f"HF_TOKEN={SECRET}\n")
    (tmp_path / "aws_credentials.json").write_text(f'{{"key": "{SECRET}"}}\n')
    subprocess.run([*git, "add", "blob.bin", "prod.env", "aws_credentials.json", ".gitattributes"], check=True)  # staged
    pwned = tmp_path.parent / f"{tmp_path.name}-pwned"  # what the tree's own configuration would run
    subprocess.run([*git, "config", "core.fsmonitor", f"touch {pwned}; false"], check=True)
    subprocess.run([*git, "config", "diff.text.textconv", f"touch {pwned}; cat"], check=True)
    subprocess.run([*git, "config", "diff.external", f"touch {pwned}"], check=True)
    state = runrecord.git_state(str(tmp_path), budget=10)
    diff = state.diff.decode()
    assert "+print(2)" in diff and "GIT binary patch" not in diff and "Binary files" in diff
    assert SECRET not in diff and sorted(state.left_out) == ["aws_credentials.json", "prod.env"]
    assert not pwned.exists(), "the checkout's own fsmonitor or textconv ran"
    assert state.as_dict()["diff_left_out"] == ["aws_credentials.json", "prod.env"]


def git_on_path(tmp_path, monkeypatch, script):
    """``script`` as the `git` the record runs: first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "git").write_text(script)
    (bin_dir / "git").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def test_a_slow_git_is_given_its_budget_and_the_launch_goes_on(tmp_path, monkeypatch):
    checkout(tmp_path)
    git_on_path(tmp_path, monkeypatch, "#!/bin/sh\nsleep 30\n")
    assert runrecord.git_state(str(tmp_path), budget=0.5) is None  # and it returned within the budget


def test_a_pipe_as_the_cluster_file_is_read_once_and_a_fifo_nobody_writes_is_an_error(tmp_path, monkeypatch):
    r, w = os.pipe()
    os.write(w, b"nodes: [{host: a, gpus: 1}]\n")
    os.close(w)
    config = load_cluster(f"/dev/fd/{r}")  # what `<(...)` gives
    os.close(r)
    assert config.source_text == "nodes: [{host: a, gpus: 1}]\n"
    os.mkfifo(tmp_path / "c.yaml")
    monkeypatch.setattr(reading, "PIPE_WAIT", 0.3)
    with pytest.raises(ConfigError, match="cannot read cluster file: the pipe did not end within 0 s"):
        load_cluster(str(tmp_path / "c.yaml"))


def test_a_runs_directory_another_user_made_is_refused(tmp_path):
    from orchestrator.ownfiles import own_dir

    theirs = tmp_path / "J"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    with pytest.raises(OSError, match="belongs to another user"):
        own_dir(str(theirs), private=True)


FAKE_GIT = """#!/bin/sh
case "$*" in
  *--show-toplevel*) echo "$FAKE_ROOT" ;;
  *"--verify -q HEAD"*) echo 0123456789abcdef0123456789abcdef01234567 ;;
  *symbolic-ref*) echo main ;;
  *) while [ ! -e "$FAKE_GATE" ]; do sleep 0.01; done; printf 'notes.txt\\0' ;;  # the tree's scans: held
esac
"""


def fake_git(tmp_path, monkeypatch):
    """A git whose diff and untracked files (the calls that read a whole tree) wait for a gate file."""
    git_on_path(tmp_path, monkeypatch, FAKE_GIT)
    monkeypatch.setenv("FAKE_ROOT", str(tmp_path))
    monkeypatch.setenv("FAKE_GATE", str(tmp_path / "gate"))
    return tmp_path / "gate"


def one_node_plan():
    from orchestrator.config.clusterfile import parse_cluster
    from orchestrator.plan.launch import make_plan

    return make_plan(parse_cluster("nodes: [{host: a, gpus: 1}]\n"), "t.py", [], "J", "/")


def test_the_launch_waits_for_the_commit_alone_and_the_logs_write_the_record_once_git_has_answered(tmp_path,
                                                                                                   monkeypatch):
    from orchestrator.views.logfiles import RunLogs

    gate = fake_git(tmp_path, monkeypatch)
    monkeypatch.setattr(runrecord, "GIT_BUDGET", 30.0)  # the gate, not the budget, ends git's scans here
    taking = runrecord.RecordTaking(["ddp-up", "c.yaml", "t.py"], "c.yaml", str(tmp_path))
    assert taking.commit == "0123456789abcdef0123456789abcdef01234567"  # while the scans still wait
    assert taking.taken() is None
    logs = RunLogs(one_node_plan(), str(tmp_path / "runs"))
    logs.record(taking)
    logs.tick(None)
    written = tmp_path / "runs" / "J" / "run.json"
    assert not written.exists()
    gate.touch()
    assert taking.done.wait(20)
    logs.tick(None)  # the loop's next tick writes it
    record = json.loads(written.read_text())
    assert record["git"]["commit"].startswith("0123") and record["git"]["untracked"] == ["notes.txt"]
    logs.close()


def test_a_tree_scan_that_never_ends_is_stopped_at_gits_budget_and_the_record_written_without_it(tmp_path,
                                                                                                 monkeypatch):
    from orchestrator.views.logfiles import RunLogs

    fake_git(tmp_path, monkeypatch)  # its gate never opens
    monkeypatch.setattr(runrecord, "GIT_BUDGET", 0.5)
    monkeypatch.setattr(runrecord, "TAKE_SLACK", 0.5)
    taking = runrecord.RecordTaking(["ddp-up", "c.yaml", "t.py"], "c.yaml", str(tmp_path))
    logs = RunLogs(one_node_plan(), str(tmp_path / "runs"))
    logs.record(taking)
    logs.close()  # waits for the record: git's scans are stopped at its budget
    record = json.loads((tmp_path / "runs" / "J" / "run.json").read_text())
    assert record["git"]["commit"].startswith("0123") and not record["git"]["dirty"]
    assert record["command"] == ["ddp-up", "c.yaml", "t.py"]


def test_a_bug_in_taking_the_record_is_shown_and_the_logs_go_on_without_it(tmp_path, monkeypatch):
    import threading

    from orchestrator.views.logfiles import RunLogs

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    shown, hooked = [], threading.Event()
    monkeypatch.setattr(threading, "excepthook", lambda args: (shown.append(args), hooked.set()))
    monkeypatch.setattr(runrecord.RunRecord, "take", broken)
    taking = runrecord.RecordTaking(["ddp-up", "c.yaml", "t.py"], "c.yaml", str(tmp_path))
    assert taking.commit is None and taking.taken(block=True) is None
    logs = RunLogs(one_node_plan(), str(tmp_path / "runs"))
    logs.record(taking)
    logs.close()
    assert logs.broken is None and not (tmp_path / "runs" / "J" / "run.json").exists()
    assert hooked.wait(10) and [str(args.exc_value) for args in shown] == ["a bug"]
