"""A kept interpreter (node/attempt/keep.py), for real: the warm interpreter of a Python session, which every
launch's agent asks on its socket (warm.KeptWarm) for its ranks. No torch: the imports are not the
subject (tests/integration/test_warm_start.py launches twice from one Python session)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.node.launchers.keptwarm import KeptWarm
from orchestrator.node.launchers.warm import Warm
from tests.harness import procs

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def kept(tmp_path):
    """A keep-mode interpreter listening in tmp_path, and a maker of its clients (one a launch)."""
    made = []

    def make(base=(), env=None):
        w = Warm(sys.executable, {"PATH": os.environ["PATH"], **(env or {})}, str(tmp_path), str(tmp_path / "log"),
                 base=base, listen=str(tmp_path / "sock"), keep=True)
        made.append(w)
        return w
    yield make
    for w in made:
        w.proc.kill()
        w.proc.wait(10)


def client(tmp_path: Path, said: list | None = None) -> KeptWarm:
    k = KeptWarm("unused", report=(said.append if said is not None else None))
    k.path = k.socket = str(tmp_path / "sock")
    return k


def run(k: KeptWarm, tmp_path: Path, script: str, name: str, env=None):
    path = tmp_path / f"{name}.py"
    path.write_text(script)
    out, err = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
    child = k.fork(0, [str(path)], env or {}, str(tmp_path), str(out), str(err))
    assert child is not None, (tmp_path / "log").read_text()
    return child, out, err


PARENT = "import json, os\nprint(json.dumps([os.getppid(), os.environ.get('LAUNCH')]))\n"


def test_every_launch_forks_from_the_same_interpreter_and_it_stays_for_the_next(kept, tmp_path):
    w = kept()
    seen = []
    for launch in ("first", "second"):
        k = client(tmp_path)  # each launch's agent: a client of its own
        assert k.ready(30), k.hello
        child, out, err = run(k, tmp_path, PARENT, launch, env={"LAUNCH": launch})
        assert child.wait(30) == 0, err.read_text()
        k.close()
        seen.append(json.loads(out.read_text()))
    assert seen == [[w.proc.pid, "first"], [w.proc.pid, "second"]]
    assert w.proc.poll() is None  # still there, for the launch after


AGENT = """
import sys, time
from orchestrator.node.launchers.keptwarm import KeptWarm
k = KeptWarm("unused")
k.path = k.socket = sys.argv[1]
assert k.ready(30)
child = k.fork(0, [sys.argv[2]], {}, sys.argv[3], sys.argv[4], sys.argv[4])
print(child.pid, flush=True)
time.sleep(120)
"""


def test_a_rank_dies_with_the_agent_that_asked_for_it(kept, tmp_path):
    """An agent killed (SIGKILL: no stop path at all): its connections end, and its ranks with them."""
    kept()
    script = tmp_path / "sleeper.py"
    script.write_text("import time\ntime.sleep(120)\n")
    agent = subprocess.Popen([sys.executable, "-c", AGENT, str(tmp_path / "sock"), str(script), str(tmp_path),
                              str(tmp_path / "out")], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        rank = int(agent.stdout.readline())
        assert procs.alive(rank)
    finally:
        agent.kill()
        agent.wait(10)
    assert procs.wait_for(lambda: not procs.alive(rank), 30), "the rank outlived its agent"


def test_a_cold_kept_interpreter_answers_every_launch_with_why_and_forks_nothing(kept, tmp_path):
    fake = tmp_path / "fake"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text("class cuda:\n    is_initialized = staticmethod(lambda: True)\n")
    w = kept(base=("torch",), env={"PYTHONPATH": str(fake)})
    for _ in range(2):  # one launch, then the next: each is told, none waits
        said = []
        k = client(tmp_path, said)
        assert k.answered(30) and not k.ready(0)
        assert said == ["ddp-up: warm start: importing torch initialized CUDA, and a process forked after that "
                        "cannot use it; the ranks start cold\n"]
        assert k.fork(0, ["x.py"], {}, str(tmp_path), str(tmp_path / "o"), str(tmp_path / "e")) is None
    assert w.proc.poll() is None  # kept: it answers the next launch too


def test_a_kept_interpreter_that_is_not_there_is_a_cold_start_after_a_bounded_wait(tmp_path, monkeypatch):
    from orchestrator.node.launchers import keptwarm

    monkeypatch.setattr(keptwarm.KeptWarm, "appear", 0.2)  # (the class's, bound as it is defined)
    said = []
    k = client(tmp_path, said)
    assert k.answered(30) and not k.ready(0)
    assert said == ["ddp-up: warm start: this session's warm interpreter is not there; the ranks start cold\n"]
