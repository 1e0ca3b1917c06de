"""A kept warm container's first process (node/launchers/boxkeep.py) and an attempt's agent asking it
(node/launchers/keptbox.py), for real but for the container: its server in this process, its warm
interpreter without torch (the imports are not the subject), the agent's side over the socket.
The container itself: tests/integration/test_containers.py."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import sys
import threading
from pathlib import Path

import pytest

from orchestrator.node.launchers import boxkeep
from orchestrator.node.launchers.keptbox import BoxWarm
from orchestrator.node.local.procs import find_tagged
from orchestrator.node.launchers.warm import Warm
from orchestrator.node.userpython.standin import PASS_VAR, SOCKET_VAR
from tests.harness import procs

SCRIPT = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: (print("saved", flush=True), sys.exit(0)))  # before its first line
print("base", os.environ.get("BASE"), "job", os.environ.get("DDP_UP_JOB"), "pass", os.environ.get("PASS_ON"),
      "socket", os.environ.get("SOCKET") is not None, flush=True)
while True:
    time.sleep(0.05)
"""
# what a stand-in would read: the variables boxwarm.start_in sets for torchrun
SCRIPT = SCRIPT.replace('"PASS_ON"', repr(PASS_VAR)).replace('"SOCKET"', repr(SOCKET_VAR))


@pytest.fixture
def box(tmp_path, monkeypatch):
    """A kept container's server listening in its kept directory (warm.kept_dir, under this test's
    state root), with a real warm interpreter; its name, for the agent's side."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    name = "t" + secrets.token_hex(4)
    where = tmp_path / f"ddp-up-{os.getuid()}" / f".warm-{name}"
    where.mkdir(parents=True, mode=0o700)
    warm = Warm(sys.executable, {"PATH": os.environ["PATH"]}, str(tmp_path), str(where / "warm.log"), base=(),
                listen=str(where / "warm.sock"), lasting=True)
    ended = threading.Event()
    server = boxkeep.Server(warm, {"PATH": os.environ["PATH"], "BASE": "image"}, ended)
    listener = boxkeep.listen(str(where), "sock")

    def serve():
        while not ended.is_set():
            try:
                conn = listener.accept()[0]
            except OSError:
                continue
            threading.Thread(target=server.answer, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    yield name, server
    ended.set()
    warm.reap(10)
    listener.close()


def launch(name: str, tmp_path: Path, job: str, said: list | None = None):
    """The attempt's launcher, as an agent asks for it: (its BoxLauncher or None, its stdout's read end)."""
    script = tmp_path / "launcher.py"
    script.write_text(SCRIPT)
    client = BoxWarm(name, report=(said.append if said is not None else None))
    assert client.ready(30), client.hello
    out_r, out_w = os.pipe()
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        child = client.launch([sys.executable, "-u", str(script)], {"DDP_UP_JOB": job}, [null, out_w, out_w], "SIGTERM")
    finally:
        os.close(null), os.close(out_w)
    return child, os.fdopen(out_r, "r")


def test_an_attempts_launcher_is_forked_there_takes_the_agents_signals_and_tells_its_end(box, tmp_path):
    name, _ = box
    child, out = launch(name, tmp_path, "job1")
    assert child is not None and child.pid is None  # its pid is the container's: never signalled from the host
    assert out.readline().split() == ["base", "image", "job", "job1", "pass", "SIGTERM", "socket", "True"]
    child.send_signal(signal.SIGTERM)  # through the container's first process
    assert child.wait(30) == 0
    assert out.readline().strip() == "saved"


def test_an_agent_gone_takes_its_attempt_with_it(box, tmp_path):
    name, _ = box
    job = "job-" + secrets.token_hex(4)
    child, out = launch(name, tmp_path, job)
    assert out.readline().startswith("base")
    assert find_tagged({"DDP_UP_JOB": job})  # its tags, in /proc/PID/environ: what the server kills by
    child.conn.shutdown(socket.SHUT_RDWR)  # the agent killed: the kernel closes its connection
    assert procs.wait_for(lambda: not find_tagged({"DDP_UP_JOB": job}), timeout=30)


def test_an_interpreter_that_cannot_fork_sends_the_attempt_to_a_container_of_its_own(box, tmp_path):
    name, server = box
    server.warm.give_up()  # it died (or took too long): nothing to fork from
    server.warm.proc.wait(10)
    said: list[str] = []
    client = BoxWarm(name, report=said.append)
    assert client.answered(30) and not client.ready(0), client.hello
    assert client.launch([sys.executable, "-u", "x.py"], {}, [0, 1, 2], "SIGTERM") is None
    assert said == ["ddp-up: warm start: the warm interpreter did not get ready; the attempt runs in a container of "
                    "its own\n"], said


@pytest.mark.parametrize("runtime,keep,detach,restarts,kept", [
    ("podman", "s1", False, 0, "session"),  # a Python session's, or a run that restarts: its keeper's
    ("docker", None, True, 1, "agent"),  # detached and restarting: the node's agent keeps it
    ("podman", None, False, 0, None),  # one attempt: its own container's interpreter (boxwarm)
    ("podman", None, True, 0, None),  # detached, no restart: the same
    ("apptainer", "s1", False, 0, None),  # no PID namespace whose end takes all: never kept
    ("enroot", None, True, 1, None),
])
def test_a_container_is_kept_under_docker_and_podman_for_a_session_or_a_run_that_restarts(
        monkeypatch, runtime, keep, detach, restarts, kept):
    from types import SimpleNamespace

    from orchestrator.node.attempt import warmline
    made, held = [], SimpleNamespace(proc=SimpleNamespace(poll=lambda: None))  # the agent's kept container, alive
    monkeypatch.setattr(warmline, "warm_interpreter", lambda *args, **kw: made.append(kw) or held)
    spec = SimpleNamespace(warm=True, warm_gpus_only=False, keep=keep, detach=detach, restarts=restarts, recoveries=0,
                           container={"runtime": runtime, "image": "img"}, preload=None, nproc=1)
    line = warmline.warm_interpreters(spec, 0, {}, "/nonexistent", SimpleNamespace(send=lambda frame, block=True: None))
    if kept == "session":
        assert isinstance(line, warmline.KeptLine) and isinstance(line.take(1), BoxWarm) and line.take(1).path.endswith(
            f".warm-{keep}/sock")
    elif kept == "agent":
        assert isinstance(line, warmline.WarmLine) and line.lasting and line.take(1) is held
    else:
        assert line is None and not made
