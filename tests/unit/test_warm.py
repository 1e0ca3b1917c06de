"""Warm start's interpreter (node/launchers/warm.py), for real: a zygote of this machine's Python, forking
scripts of ours. It imports only what each test names (no torch: the import is not the subject);
the torch jobs run warm in tests/integration/test_warm_start.py."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from orchestrator.node.launchers.warm import Warm, store_to_await
from tests.harness.procs import wait_for

SCRIPT = textwrap.dedent('''
    import ctypes, json, os, sys
    libc = ctypes.CDLL(None)
    libc.getenv.restype = ctypes.c_char_p
    print(json.dumps({"name": __name__, "argv": sys.argv, "file": __file__, "cwd": os.getcwd(),
                      "env": os.environ.get("ONLY_THE_RANK"), "c_env": (libc.getenv(b"ONLY_THE_RANK") or b"").decode(),
                      "zygote_var": os.environ.get("ONLY_THE_ZYGOTE"), "path0": sys.path[0],
                      "own_session": os.getsid(0) == os.getpid(), "stdin": sys.stdin.read(),
                      "helper_seen": "say" in globals(), "cmdline": open("/proc/self/cmdline", "rb").read().decode()}))
    sys.exit(int(sys.argv[1]))
''')


@pytest.fixture
def warm(tmp_path):
    made = []

    def make(preload=(), base=(), env=None):
        w = Warm(sys.executable, {"ONLY_THE_ZYGOTE": "z", "PATH": os.environ["PATH"], **(env or {})}, str(tmp_path),
                 str(tmp_path / "warm.log"), preload, base=base)
        made.append(w)
        return w
    yield make
    for w in made:
        if w.proc.poll() is None:
            w.proc.kill()
        w.proc.wait(10)


def fork(w, tmp_path: Path, script: str, *args: str, rank: int = 0, env=None, cwd=None):
    path = tmp_path / f"script{rank}.py"
    path.write_text(script)
    out, err = tmp_path / f"out{rank}", tmp_path / f"err{rank}"
    child = w.fork(rank, [str(path), *args], env or {"ONLY_THE_RANK": "r"}, str(cwd or tmp_path), str(out), str(err))
    assert child is not None, (tmp_path / "warm.log").read_text()
    return child, out, err


def test_a_forked_rank_is_what_python_script_args_would_be(warm, tmp_path):
    w = warm()
    assert w.ready(30), w.hello
    other = tmp_path / "elsewhere"
    other.mkdir()
    child, out, err = fork(w, tmp_path, SCRIPT, "3", "--flag", cwd=other)
    assert child.wait(30) == 3, err.read_text()
    seen = json.loads(out.read_text())
    script = str(tmp_path / "script0.py")
    assert seen["name"] == "__main__" and seen["argv"] == [script, "3", "--flag"] and seen["file"] == script
    assert seen["cwd"] == str(other) and seen["path0"] == str(tmp_path)
    assert seen["env"] == seen["c_env"] == "r"  # os.environ and the C library's, which NCCL reads
    assert seen["zygote_var"] is None  # the rank's environment, not its interpreter's
    assert seen["own_session"] and seen["stdin"] == "" and not seen["helper_seen"]
    assert seen["cmdline"].split("\0")[:4] == [sys.executable, "-u", script, "3"]  # ps names the rank's script


def test_what_the_interpreter_imported_is_frozen_out_of_the_ranks_collections(warm, tmp_path):
    """gc.freeze() before the forks: a rank's collections, and the last one at its exit, skip the
    interpreter's objects (a forked rank with torch imported took 0.8 s to exit, 0.3 s frozen)."""
    w = warm(preload=("json", "email.parser"))
    assert w.ready(30), w.hello
    child, out, err = fork(w, tmp_path, "import gc, sys\nprint(gc.get_freeze_count(), gc.isenabled(), "
                                        "'email.parser' in sys.modules)\n")
    assert child.wait(30) == 0, err.read_text()
    frozen, enabled, preloaded = out.read_text().split()
    assert int(frozen) > 1000 and enabled == "True" and preloaded == "True"  # the rank's own objects: collected


def test_proc_environ_shows_what_the_rank_added_to_its_interpreter_s_environment(warm, tmp_path):
    """ddp-kill, the stack dumps and ps -e read a rank's RANK from /proc/PID/environ."""
    w = warm()
    assert w.ready(30)
    child, out, err = fork(w, tmp_path, "import time\nprint('up', flush=True)\ntime.sleep(60)\n",
                           env={"RANK": "7", "LOCAL_RANK": "1", "ONLY_THE_ZYGOTE": "z", "NEW": "v" * 100})
    try:
        for _ in range(400):
            if out.exists() and out.read_text():
                break
            child.ended.wait(0.05)
        shown = [e for e in Path(f"/proc/{child.pid}/environ").read_bytes().split(b"\0") if e]
        assert shown[-3:] == [b"RANK=7", b"LOCAL_RANK=1", b"NEW=" + b"v" * 100], shown  # after the interpreter's
        assert b"ONLY_THE_ZYGOTE=z" in shown and not any(e.startswith(b"DDP_UP_WARM_ROOM") for e in shown)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(30)


def test_an_uncaught_exception_is_code_1_with_the_script_s_traceback(warm, tmp_path):
    w = warm()
    assert w.ready(30)
    child, _, err = fork(w, tmp_path, "def f():\n    raise ValueError('boom')\nf()\n")
    assert child.wait(30) == 1
    text = err.read_text()
    assert text.startswith("Traceback (most recent call last):\n  File \"%s\", line 3, in <module>" % (
        tmp_path / "script0.py")), text
    assert text.rstrip().endswith("ValueError: boom") and "runpy" not in text


def test_a_signal_ends_a_rank_with_the_negative_signal_number_as_popen_does(warm, tmp_path):
    w = warm()
    assert w.ready(30)
    child, out, _ = fork(w, tmp_path, "import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    for _ in range(200):
        if out.exists() and out.read_text():
            break
        child.ended.wait(0.05)
    os.kill(child.pid, signal.SIGTERM)
    assert child.wait(30) == -signal.SIGTERM


def test_spawned_multiprocessing_workers_find_the_script_s_own_functions(warm, tmp_path):
    """A DataLoader's workers with spawn re-import __main__ from its file: they must find it."""
    w = warm()
    assert w.ready(30)
    script = ("import multiprocessing as mp\ndef square(x):\n    return x * x\n"
              "if __name__ == '__main__':\n    with mp.get_context('spawn').Pool(1) as p:\n"
              "        print('squares', p.map(square, [2, 3]))\n")
    child, out, err = fork(w, tmp_path, script)
    assert child.wait(60) == 0, err.read_text()
    assert out.read_text() == "squares [4, 9]\n"


def test_every_rank_of_an_attempt_then_the_interpreter_ends(warm, tmp_path):
    w = warm()
    assert w.ready(30)
    children = [fork(w, tmp_path, "import os, sys\nsys.exit(int(os.environ['RANK']))\n", rank=r,
                     env={"RANK": str(r)})[0] for r in range(3)]
    w.close()
    assert [c.wait(30) for c in children] == [0, 1, 2]
    assert w.proc.wait(10) == 0  # nothing of it is left


def test_a_module_that_fails_to_import_is_a_notice_and_the_rest_stays_warm(warm, tmp_path):
    w = warm(preload=("json", "no_such_module_anywhere"))
    assert w.ready(30)
    assert len(w.hello["notices"]) == 1 and "no_such_module_anywhere" in w.hello["notices"][0]



def test_the_interpreter_shows_in_ps_as_one_named_line_and_still_carries_its_mark(warm, tmp_path):
    from orchestrator.node.local.procs import WARM_MARK
    w = warm()
    assert w.ready(30), w.hello
    words = Path(f"/proc/{w.proc.pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    assert words[:3] == [sys.executable.encode(), b"-u", b"-c"] and len(words) == 4, words
    assert words[3].decode().startswith(WARM_MARK) and len(words[3]) < 120, words
    assert Path(f"/proc/{w.proc.pid}/comm").read_text().strip() == "ddp-up-warm"
    child, out, _ = fork(w, tmp_path, SCRIPT, "0")  # its ranks still get their own variables in /proc
    assert child.wait(30) == 0, (tmp_path / "warm.log").read_text()
    assert json.loads(out.read_text())["env"] == "r"


# What each kind of early CUDA use does to torch (each seen on an H200, torch 2.11): a context made
# (torch.cuda.init()), or only the device count asked of the driver (torch.cuda.is_available()),
# after which torch marks every forked child a "bad fork" and refuses CUDA there.
EAGER = {"context": "import torch\ntorch.cuda.is_initialized = lambda: True\n",
         "device count": "import os, torch\nforked = []\nos.register_at_fork(after_in_child=lambda: forked.append(1))\n"
                         "torch.cuda._is_in_bad_fork = lambda: bool(forked)\n"}


@pytest.mark.parametrize("use", sorted(EAGER))
def test_a_module_that_initialized_cuda_starts_the_ranks_cold_and_says_which(warm, tmp_path, use):
    fake = tmp_path / "fake"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text("class cuda:\n    is_initialized = staticmethod(lambda: False)\n"
                                                "    _is_in_bad_fork = staticmethod(lambda: False)\n")
    (fake / "eager.py").write_text(EAGER[use])
    (fake / "harmless.py").write_text("import torch\n")
    assert warm(base=("torch",), preload=("harmless",), env={"PYTHONPATH": str(fake)}).ready(30)
    w = warm(base=("torch",), preload=("eager",), env={"PYTHONPATH": str(fake)})
    assert not w.ready(30)
    assert "importing eager initialized CUDA" in w.why_cold()
    assert w.fork(0, ["x.py"], {}, str(tmp_path), "o", "e") is None


def test_an_interpreter_that_said_cold_is_not_waited_for_as_if_it_still_imported(warm, tmp_path, monkeypatch):
    """Its Ready goes at once, with the one notice it gave: not after READY_WAIT, nor with a second
    notice that the imports took too long (seen on an H200, where a preload initialized CUDA)."""
    from types import SimpleNamespace

    from orchestrator.node.attempt import run, warmline
    from orchestrator.node.protocol import wire
    fake = tmp_path / "fake"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text("class cuda:\n    is_initialized = staticmethod(lambda: True)\n")
    cold = warm(base=("torch",), env={"PYTHONPATH": str(fake)})
    monkeypatch.setattr(warmline, "warm_interpreter", lambda *args: cold)
    monkeypatch.setattr(warmline, "READY_WAIT", 60.0)
    sent = []
    out = SimpleNamespace(send=lambda frame, block=True: sent.append(frame))
    spec = SimpleNamespace(warm=True, warm_gpus_only=False, container=None, detach=False, heartbeat=0.05, keep=None,
                           job="j", node=0, run="r", attempt=0, orphan_timeout=30.0)
    runner = run.Runner(spec, out)
    runner.warm = line = warmline.warm_interpreters(spec, 0, {}, str(tmp_path), out)
    assert warmline.await_warm(runner) is None
    assert cold.answered(0) and not cold.ready(0)  # back before READY_WAIT: it had answered
    said = [f.data for f in sent if isinstance(f, wire.Output)]
    assert not any(b"took too long" in d for d in said), said
    assert cold.proc.wait(10) == 0  # it ended on its own, not killed as a slow one
    assert line.take(0) is cold


def test_a_stop_while_the_interpreter_imports_is_acted_on_at_once(warm, tmp_path, monkeypatch):
    """Another node failed its preflight: this one stops now, not once its imports are done."""
    from types import SimpleNamespace

    from orchestrator.node.protocol import events
    from orchestrator.node.attempt import run, warmline
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "slowmod.py").write_text("import time\ntime.sleep(60)\n")
    slow = warm(preload=("slowmod",), env={"PYTHONPATH": str(fake)})
    monkeypatch.setattr(warmline, "warm_interpreter", lambda *args: slow)
    spec = SimpleNamespace(warm=True, warm_gpus_only=False, container=None, detach=False, heartbeat=0.05, keep=None,
                           job="j", node=0, run="r", attempt=0, orphan_timeout=30.0)
    runner = run.Runner(spec, SimpleNamespace(send=lambda frame, block=True: None))
    runner.warm = warmline.warm_interpreters(spec, 0, {}, str(tmp_path), runner.out)
    runner.events.put(events.Stop("stopped by ddp-up"))
    assert warmline.await_warm(runner) == events.Stop("stopped by ddp-up")
    assert not slow.answered(0)  # still importing: nothing waited for it


def test_imports_still_running_at_the_go_start_the_ranks_cold_with_one_notice(warm, tmp_path):
    """The node's Ready waited READY_WAIT already (patience 0): the ranks start cold at once, the
    interpreter is ended (its import would take the ranks' CPU), and it says so once."""
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "slowmod.py").write_text("import time\ntime.sleep(60)\n")
    slow = warm(preload=("slowmod",), env={"PYTHONPATH": str(fake)})
    said = []
    slow.report, slow.patience = said.append, 0
    assert [fork_or_none(slow, tmp_path, r) for r in (0, 1)] == [None, None]
    assert said == ["ddp-up: warm start: the imports took too long; the ranks start cold\n"]
    assert slow.proc.wait(10) == -signal.SIGKILL


def fork_or_none(w, tmp_path, rank):
    return w.fork(rank, [str(tmp_path / "x.py")], {}, str(tmp_path), str(tmp_path / "o"), str(tmp_path / "e"))


def test_an_interpreter_ends_with_its_agent_even_while_it_still_imports(tmp_path):
    """Whatever ends the agent (a Go that never came, a SIGKILL), its warm interpreter goes too."""
    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "sleepy.py").write_text("import time\ntime.sleep(60)\n")
    agent = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import os, sys
        from orchestrator.node.launchers.warm import Warm
        w = Warm(sys.executable, {{"PYTHONPATH": {str(slow)!r}}}, {str(tmp_path)!r}, {str(tmp_path / "log")!r},
                 ("sleepy",), base=())
        print(w.proc.pid, flush=True)
        os._exit(0)
    """)], capture_output=True, text=True, timeout=30)
    pid = int(agent.stdout)
    for _ in range(200):
        if not os.path.exists(f"/proc/{pid}") or b"Z" in Path(f"/proc/{pid}/stat").read_bytes().split(b")")[-1][:3]:
            break
        signal.sigtimedwait([], 0.05)
    assert not os.path.exists(f"/proc/{pid}") or b"Z" in Path(f"/proc/{pid}/stat").read_bytes().split(b")")[-1][:3]


def test_a_module_target_runs_as_python_m_would(warm, tmp_path):
    """`ddp-up CLUSTER -m pkg.train ARGS` (and the Python API's callables): the module by its name,
    the working directory first on the path, sys.argv[0] its file."""
    w = warm()
    assert w.ready(30)
    (tmp_path / "mymod.py").write_text("import json, sys\nprint(json.dumps([__name__, sys.argv, sys.path[0]]))\n")
    out, err = tmp_path / "out", tmp_path / "err"
    child = w.fork(0, ["-m", "mymod", "a"], {}, str(tmp_path), str(out), str(err))
    assert child.wait(30) == 0, err.read_text()
    assert json.loads(out.read_text()) == ["__main__", [str(tmp_path / "mymod.py"), "a"], str(tmp_path)]


def test_a_rank_s_own_pythonpath_is_on_its_path_as_in_a_cold_start(warm, tmp_path):
    """The Python API's ranks run `-m ddp_up_call` from the attempt's hook folder, which only the
    rank's PYTHONPATH names: the interpreter started before that folder was made."""
    w = warm(env={"PYTHONPATH": str(tmp_path / "its_own")})
    assert w.ready(30)
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "hooked.py").write_text("import json, sys\nprint(json.dumps(sys.path[:3]))\n")
    out, err = tmp_path / "out", tmp_path / "err"
    child = w.fork(0, ["-m", "hooked"], {"PYTHONPATH": f"{hooks}{os.pathsep}{tmp_path / 'user'}"}, str(tmp_path),
                   str(out), str(err))
    assert child.wait(30) == 0, err.read_text()
    path = json.loads(out.read_text())
    assert path == [str(tmp_path), str(hooks), str(tmp_path / "user")]


FAKE_RUN = textwrap.dedent('''
    import atexit, sys, threading, time
    def late():
        time.sleep(0.3)
        print("thread joined", flush=True)
    threading.Thread(target=late).start()  # not a daemon: the end waits for it, as Python's does
    atexit.register(lambda: print("atexit ran", flush=True))
    print("launcher ran", flush=True)
    if sys.argv[1] == "raise":
        raise RuntimeError("a rank failed")
    sys.exit(int(sys.argv[1]) if sys.argv[1] != "none" else None)
''')


@pytest.mark.parametrize("how, code", [("3", 3), ("none", 0), ("raise", 1)])
def test_torchrun_forked_ends_as_python_would_without_the_interpreters_teardown(warm, tmp_path, how, code):
    """torchrun (`-m torch.distributed.run`, here a stand-in package first on the path) joins its
    threads, runs its atexit functions and ends with Python's status, but frees no module's objects
    (a forked process would write to every page it shares with its interpreter): the object that
    says so when freed never does."""
    fake = tmp_path / "fake" / "torch" / "distributed"
    fake.mkdir(parents=True)
    (fake.parent / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("class Freed:\n    def __del__(self):\n        print('teardown ran', flush=True)\n"
                                      "KEPT = Freed()\n")
    (fake / "run.py").write_text(FAKE_RUN)
    w = warm()
    assert w.ready(30)
    out, err = tmp_path / "out", tmp_path / "err"
    child = w.fork(None, ["-m", "torch.distributed.run", how], {"PYTHONPATH": str(tmp_path / "fake")}, str(tmp_path),
                   str(out), str(err))
    assert child is not None and child.wait(30) == code, err.read_text()
    assert out.read_text().splitlines() == ["launcher ran", "thread joined", "atexit ran"], (out.read_text(), err.read_text())
    assert ("RuntimeError: a rank failed" in err.read_text()) is (how == "raise")
    (tmp_path / "mine.py").write_text("import torch.distributed\n" + FAKE_RUN)  # a user's module: torn down as usual
    child = w.fork(None, ["-m", "mine", how], {"PYTHONPATH": str(tmp_path / "fake")}, str(tmp_path), str(out), str(err))
    assert child.wait(30) == code
    assert out.read_text().splitlines()[-1] == "teardown ran", out.read_text()


def test_torchrun_forked_on_a_node_other_than_the_master_starts_once_the_masters_store_listens(warm, tmp_path):
    """Forked the moment its node's imports end, torchrun would connect to a master's store not up
    yet and back off for up to a second: it starts once the master's port listens instead. The
    port is bound but not listening first (refused, as before the master's torchrun is there)."""
    fake = tmp_path / "fake" / "torch" / "distributed"
    fake.mkdir(parents=True)
    (fake.parent / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("")
    (fake / "run.py").write_text("import time\nprint(time.monotonic(), flush=True)\n")
    store = socket.socket()
    store.bind(("127.0.0.1", 0))
    port = store.getsockname()[1]
    w = warm()
    assert w.ready(30)
    out, err = tmp_path / "out", tmp_path / "err"
    # localhost: each address it resolves to is tried (::1 first where it does, refused: the store is on IPv4)
    argv = ["-m", "torch.distributed.run", "--nnodes=2", "--node-rank=1", "--master-addr=localhost",
            f"--master-port={port}", "--redirects=3", "train.py"]
    child = w.fork(None, argv, {"PYTHONPATH": str(tmp_path / "fake")}, str(tmp_path), str(out), str(err))
    try:
        deadline = time.monotonic() + 30
        while b"torch.distributed.run" not in Path(f"/proc/{child.pid}/cmdline").read_bytes():
            assert time.monotonic() < deadline, "the fork never became torchrun"
            time.sleep(0.01)
        time.sleep(0.3)  # room for a torchrun that does not wait to run
        listening_at = time.monotonic()
        store.listen(8)
        assert child.wait(30) == 0, err.read_text()
        assert float(out.read_text()) >= listening_at
    finally:
        store.close()


def test_only_torchrun_on_a_node_other_than_the_master_waits_for_the_masters_store():
    line = ["-m", "torch.distributed.run", "--nnodes=4", "--nproc-per-node=2", "--node-rank=2",
            "--master-addr=10.0.0.1", "--master-port=29500", "--redirects=3", "--no-python", "python3", "-S",
            "-c--node-rank=0", "train.py", "--master-port=1"]
    assert store_to_await(None, line) == {"after": ["10.0.0.1", 29500]}
    assert store_to_await(None, [w.replace("--node-rank=2", "--node-rank=0") for w in line]) == {}  # the master
    assert store_to_await(0, line) == {}  # a rank, not torchrun
    assert store_to_await(None, ["-m", "mine"] + line[2:]) == {}
    assert store_to_await(None, [w for w in line if not w.startswith("--master-addr")]) == {}


def test_a_detached_job_forks_every_attempt_from_one_interpreter_that_no_attempt_end_kills(tmp_path, monkeypatch):
    """Detached with restarts left, the agent runs every attempt: one interpreter forks them all
    (a restart never waits for one still importing). It carries the job's tags less the
    attempt's, so an attempt's end (launch.Launch.end, by the attempt's tags) leaves it; an
    attempt's close leaves it open; once it has ended, the next attempt makes another."""
    import functools
    from types import SimpleNamespace

    from orchestrator.node.attempt import warmline
    from orchestrator.node.local.procs import carries, read_tags
    monkeypatch.setattr(warmline, "Warm", functools.partial(Warm, base=()))  # no torch: not the subject
    spec = SimpleNamespace(warm=True, warm_gpus_only=False, container=None, detach=True, restarts=1, recoveries=0,
                           keep=None, preload=None, nproc=1, job="20261128-000000-aaaaaa", node=0, run="r1", cluster="c1")
    line = warmline.warm_interpreters(spec, 0, {"PATH": os.environ["PATH"], "DDP_UP_ATTEMPT": "0"}, str(tmp_path),  # the agent's
                                 SimpleNamespace(send=lambda frame, block=True: None))
    made = [line.take(0)]
    try:
        first = made[0]
        assert first.ready(30)
        tags = read_tags(first.proc.pid)
        assert tags["DDP_UP_JOB"] == spec.job and carries(tags, {"DDP_UP_NODE": "0", "DDP_UP_RUN": "r1"})
        assert not carries(tags, {"DDP_UP_ATTEMPT": "0"})  # attempt 0's end does not take it
        child, _, _ = fork(first, tmp_path, "import sys\nsys.exit(0)\n")
        first.close()  # as Workers does once an attempt's ranks are all forked
        assert child.wait(30) == 0
        assert line.take(1) is first and first.proc.poll() is None
        child, _, _ = fork(first, tmp_path, "import sys\nsys.exit(4)\n", rank=1)
        assert child.wait(30) == 4
        first.proc.kill()
        first.proc.wait(10)
        made.append(line.take(2))
        assert made[1] is not first and made[1].ready(30)
    finally:
        for w in made:
            if w is not None and w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait(10)


def test_a_node_whose_preflight_fails_ends_its_early_interpreter_and_says_nothing_of_it(warm, tmp_path):
    """The interpreter starts as the preflight begins (it imports while the versions are read):
    its notices are held until the preflight passed, and a node that fails ends it first."""
    from types import SimpleNamespace

    from orchestrator.node.attempt import warmline
    sent = []
    held = warmline.HeldFrames(SimpleNamespace(send=lambda frame, block=True: sent.append(frame)))
    held.send("warm notice")
    assert sent == []
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "slowmod.py").write_text("import time\ntime.sleep(60)\n")
    slow = warm(preload=("slowmod",), env={"PYTHONPATH": str(fake)})
    warmline.end_warm(warmline.WarmLine(lambda attempt: slow, 0, False))  # the preflight failed: nothing is released
    assert slow.proc.returncode is not None and sent == []  # ended, and reaped by the agent
    held.release()  # it passed: what was held goes, in order, and then each as it comes
    held.send("later")
    assert sent == ["warm notice", "later"]


# --- a forked rank is a cold rank (docs/guides/warm-start.md, "What a rank gets anew") ---------------

DRAWS = "import json, random, numpy\nprint(json.dumps([numpy.random.randint(1 << 30), random.getrandbits(30)]))\n"


def test_each_rank_draws_its_own_random_numbers_as_a_new_process_does(warm, tmp_path):
    w = warm(preload=("numpy.random",))  # NumPy 2 imports it on first use: here, as a preload that uses it
    assert w.ready(60), w.hello
    draws = []
    for rank in range(2):
        child, out, err = fork(w, tmp_path, DRAWS, rank=rank)
        assert child.wait(30) == 0, err.read_text()
        draws.append(json.loads(out.read_text()))
    assert draws[0][0] != draws[1][0], draws  # NumPy's global generator: copied whole by the fork before
    assert draws[0][1] != draws[1][1], draws  # Python's: CPython reseeds it in the child itself


def test_torch_s_generator_is_fresh_in_each_rank_unless_a_preload_seeded_it(warm, tmp_path):
    script = "import json, torch\nprint(json.dumps([torch.initial_seed(), torch.rand(1).item()]))\n"
    (tmp_path / "seeds.py").write_text("import torch\ntorch.manual_seed(1234)\n")
    for preload, fresh in (((), True), (("seeds",), False)):
        w = warm(base=("torch",), preload=preload)
        assert w.ready(60), w.hello
        seen = []
        for rank in range(2):
            (tmp_path / f"out{rank}").unlink(missing_ok=True)
            child, out, err = fork(w, tmp_path, script, rank=rank)
            assert child.wait(60) == 0, err.read_text()
            seen.append(json.loads(out.read_text()))
        assert (seen[0] != seen[1]) is fresh, (preload, seen)  # a seed at import: every cold rank has it too
        if not fresh:
            assert seen[0][0] == 1234


def test_an_import_that_leaves_an_openmp_pool_starts_the_ranks_cold_and_says_which(warm, tmp_path):
    """A parallel region at import (a warm-up matmul) leaves OpenMP's threads, which a forked child
    waits for in its own next region, for good: the probe's child hangs, not the ranks."""
    (tmp_path / "warmup.py").write_text("import torch\ntorch.set_num_threads(2)\ntorch.ones(512, 512).mm(torch.ones(512, 512))\n")
    w = warm(base=("torch",), preload=("warmup",))
    assert not w.ready(60)
    assert "importing warmup left a thread pool" in w.why_cold(), w.why_cold()
    assert w.fork(0, ["x.py"], {}, str(tmp_path), "o", "e") is None
    ok = warm(base=("torch", "numpy"))  # NumPy's BLAS threads, which stop around a fork, are no reason
    assert ok.ready(60), ok.hello


CHANGES = {"a thread": ("import threading, time\nthreading.Thread(target=time.sleep, args=(60,), name='poller', "
                        "daemon=True).start()\n", "started a thread (poller)"),
           "sys.path": ("import sys\nsys.path.insert(0, '/opt/vendored')\n", "changed the process's sys.path"),
           "cwd": ("import os\nos.chdir('/')\n", "working directory"),
           "a signal": ("import signal\nsignal.signal(signal.SIGUSR2, lambda *_: None)\n", "signal handlers"),
           "umask": ("import os\nos.umask(0o077)\n", "umask")}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_an_import_that_changed_the_process_starts_the_ranks_cold_and_names_the_module(warm, tmp_path, change):
    text, said = CHANGES[change]
    (tmp_path / "changer.py").write_text(text)
    w = warm(preload=("json", "changer"))
    assert not w.ready(30)
    assert "importing changer" in w.why_cold() and said in w.why_cold(), w.why_cold()


def test_the_variables_an_import_set_are_the_ranks_too_as_its_own_import_would_set_them(warm, tmp_path):
    (tmp_path / "setter.py").write_text("import os\nos.environ['SET_AT_IMPORT'] = 'yes'\nos.environ.pop('DROPPED', None)\n")
    w = warm(preload=("setter",), env={"DROPPED": "1"})
    assert w.ready(30), w.hello
    script = "import json, os\nprint(json.dumps([os.environ.get('SET_AT_IMPORT'), os.environ.get('DROPPED')]))\n"
    child, out, err = fork(w, tmp_path, script, env={"DROPPED": "1"})
    assert child.wait(30) == 0, err.read_text()
    assert json.loads(out.read_text()) == ["yes", None]


def test_an_import_that_read_the_rank_s_variables_forks_no_rank_that_has_them(warm, tmp_path):
    """What it made of RANK at import (absent then) would be every rank's: that rank starts cold, said."""
    (tmp_path / "ranked.py").write_text("import os\nRANK = int(os.environ.get('RANK', 0))\n")
    w = warm(preload=("ranked",))
    assert w.ready(30), w.hello
    said = []
    w.report = said.append
    child, out, err = fork(w, tmp_path, "print('no rank variable')\n", env={"OTHER": "1"})  # nothing it read: warm
    assert child.wait(30) == 0
    path = tmp_path / "r.py"
    path.write_text("print(1)\n")
    assert w.fork(1, [str(path)], {"RANK": "1"}, str(tmp_path), str(tmp_path / "o"), str(tmp_path / "e")) is None
    assert said and "importing ranked read RANK" in said[0], said


def test_lightning_s_rank_is_the_rank_s_own_after_the_fork(warm, tmp_path):
    """Lightning reads the rank at import for @rank_zero_only: redone in the rank, so it stays warm."""
    fake = tmp_path / "fake"
    where = fake / "lightning" / "fabric" / "utilities"
    where.mkdir(parents=True)
    for d in (fake / "lightning", fake / "lightning" / "fabric", where):
        (d / "__init__.py").write_text("")
    (where / "rank_zero.py").write_text(
        "import os\ndef _get_rank():\n    for key in ('RANK', 'LOCAL_RANK'):\n        if os.environ.get(key) is not None:\n"
        "            return int(os.environ[key])\n    return None\n"
        "def rank_zero_only(fn):\n    return fn\nrank_zero_only.rank = getattr(rank_zero_only, 'rank', _get_rank() or 0)\n")
    w = warm(preload=("lightning.fabric.utilities.rank_zero",), env={"PYTHONPATH": str(fake)})
    assert w.ready(30), w.hello
    script = "from lightning.fabric.utilities.rank_zero import rank_zero_only\nprint(rank_zero_only.rank)\n"
    child, out, err = fork(w, tmp_path, script, env={"RANK": "3", "PYTHONPATH": str(fake)})
    assert child.wait(30) == 0, err.read_text()
    assert out.read_text().strip() == "3"


def test_a_module_edited_on_disk_is_never_forked_old(warm, tmp_path):
    """The interpreter refuses the fork, ends once its ranks have, and the rank starts cold (the next
    attempt, or launch, makes a fresh interpreter)."""
    (tmp_path / "model.py").write_text("VERSION = 1\n")
    w = warm(preload=("model",))
    assert w.ready(30), w.hello
    script = "import model\nprint(model.VERSION)\n"
    child, out, _ = fork(w, tmp_path, script)
    assert child.wait(30) == 0 and out.read_text().strip() == "1"
    time.sleep(0.6)  # past the 0.5 s a check of the files holds
    (tmp_path / "model.py").write_text("VERSION = 22\n")
    said = []
    w.report = said.append
    path = tmp_path / "again.py"
    path.write_text(script)
    assert w.fork(1, [str(path)], {}, str(tmp_path), str(tmp_path / "o"), str(tmp_path / "e")) is None
    assert said and "model.py changed on disk" in said[0], said
    assert w.proc.wait(30) == 0  # it forks nothing more, and is gone


@pytest.mark.parametrize("interpreters, ranks, elsewhere", [
    ("{pp}:", "{hooks}:{pp}:", False),  # an empty entry is the working directory, as in a cold start
    (":{pp}", "{hooks}::{pp}", False),  # ... and a path is on sys.path once
    ("rel", "{hooks}:rel", True),  # a relative entry is from the rank's own working directory
    ("{pp}", "{pp}", True),
])
def test_a_rank_s_sys_path_is_the_one_its_cold_start_makes(warm, tmp_path, interpreters, ranks, elsewhere):
    where = {"pp": str(tmp_path / "pp"), "hooks": str(tmp_path / "hooks")}
    cwd = tmp_path / "other" if elsewhere else tmp_path
    cwd.mkdir(exist_ok=True)
    w = warm(env={"PYTHONPATH": interpreters.format(**where)})
    assert w.ready(30), w.hello
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": ranks.format(**where)}
    script = "import json, sys\nprint(json.dumps(sys.path))\n"
    child, out, err = fork(w, tmp_path, script, env=env, cwd=cwd)
    assert child.wait(30) == 0, err.read_text()
    cold = subprocess.run([sys.executable, "-u", str(tmp_path / "script0.py")], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=60)
    assert json.loads(out.read_text()) == json.loads(cold.stdout)


def test_a_slow_client_of_the_interpreter_s_socket_holds_up_no_fork(tmp_path):
    """One of this user's processes connects and sends a byte at a time: the interpreter reads it as
    it comes, forks meanwhile, and drops it past its bound."""
    bound = 5.0  # warmparent.REQUEST_BOUND: seconds an asker has to send its whole request
    sock = tmp_path / "w.sock"
    w = Warm(sys.executable, {"PATH": os.environ["PATH"]}, str(tmp_path), str(tmp_path / "warm.log"), (), base=(),
             listen=str(sock))
    try:
        assert w.ready(30), w.hello
        slow = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        slow.connect(str(sock))
        slow.send(b"\n{")  # and nothing more for now
        start = time.monotonic()
        child, out, err = fork(w, tmp_path, "print('forked')\n")
        assert child.wait(30) == 0 and out.read_text() == "forked\n", err.read_text()
        assert time.monotonic() - start < bound  # not after the slow one's bound
        slow.settimeout(bound + 10)
        assert slow.recv(1) == b""  # dropped at its bound, unanswered
        slow.close()
    finally:
        w.proc.kill()
        w.proc.wait(10)


# --- the interpreter's own failures, told as they are --------------------------------------------

def test_an_interpreter_that_dies_importing_says_so_at_once_naming_the_module(warm, tmp_path):
    (tmp_path / "quitter.py").write_text("import os\nos._exit(3)\n")
    said = []
    w = warm(preload=("json", "quitter"))
    w.report = said.append
    start = time.monotonic()
    assert not w.ready(30)
    assert time.monotonic() - start < 10  # not after the imports' patience
    assert "exited with status 3 importing quitter" in w.why_cold(), w.why_cold()
    assert said and "importing quitter" in said[0] and "took too long" not in " ".join(said), said


def test_a_preload_that_raises_with_a_long_message_is_one_short_notice(warm, tmp_path):
    (tmp_path / "loud.py").write_text("raise RuntimeError('x' * 5_000_000)\n")
    w = warm(preload=("loud",))
    assert w.ready(30), w.hello
    [notice] = w.hello["notices"]
    assert "preload loud failed (RuntimeError: xxx" in notice and len(notice) < 500


def test_a_preload_that_never_returns_is_named_when_it_is_given_up_on(warm, tmp_path):
    (tmp_path / "stuck.py").write_text("import time\ntime.sleep(600)\n")
    said = []
    w = warm(preload=("stuck",))
    w.report, w.patience = said.append, 2.0
    assert w.fork(0, ["x.py"], {}, str(tmp_path), "o", "e") is None
    assert said == ["ddp-up: warm start: the imports took too long (still importing stuck); the ranks start cold\n"]


def test_an_interpreter_killed_while_its_ranks_run_is_named_at_once(warm, tmp_path):
    said = []
    w = warm()
    assert w.ready(30), w.hello
    w.report = said.append
    child, out, err = fork(w, tmp_path, "import time\nprint('up', flush=True)\ntime.sleep(3)\n")
    assert wait_for(lambda: out.exists() and out.read_text() == "up\n", 30)
    w.proc.kill()
    assert wait_for(lambda: said, 30), said
    assert said[0].startswith(f"ddp-up: warm start: the warm interpreter (pid {w.proc.pid}) was killed by SIGKILL "
                              "while 1 process(es) it forked ran"), said
    assert child.wait(30) == 1 and "killed by SIGKILL" in child.lost  # its end waited for, its status unknown


class Vanished:
    """A kept interpreter as fork_torchrun sees it: usable or not, and whose folder is gone."""

    instead, socket = "the ranks start cold", "/nowhere/sock"

    def __init__(self, usable):
        self.ok, self.said, self.forked = usable, [], False

    def usable(self):
        return self.ok

    @property
    def code(self):
        raise FileNotFoundError(2, "No such file or directory")

    def report(self, text):
        self.said.append(text)

    def fork(self, *args, **kwargs):
        self.forked = True


@pytest.mark.parametrize("usable", [True, False])
def test_a_warm_interpreter_whose_folder_vanished_starts_the_ranks_cold_and_fails_none(usable):
    """A node cut off as its agent started: its kept interpreter's folder went, and torchrun's fork
    once raised FileNotFoundError, reported as the rank's failure, after the agent had said the
    ranks start cold. Now: cold, said once, no failure."""
    from orchestrator.node.launchers.warm import fork_torchrun

    warm = Vanished(usable)
    assert fork_torchrun(warm, ["-m", "torch.distributed.run", "x.py"], {}, "SIGTERM", [0, 1, 2]) is None
    assert not warm.forked
    assert warm.said == (["ddp-up: warm start: the warm interpreter's folder is gone (No such file or directory); "
                          "the ranks start cold\n"] if usable else [])


def test_a_variable_an_import_read_then_set_itself_sends_no_rank_cold(monkeypatch):
    """torch's inductor reads TORCHINDUCTOR_CACHE_DIR at import, finds none, and sets it to its
    default: the rank inherits that value, and its own import would find the same. A rank whose
    value is its own (RANK, LOCAL_RANK read by a module ddp-up cannot redo) still forks cold."""
    from orchestrator.node.userpython import beforefork

    monkeypatch.setattr(beforefork, "python_threads", lambda: [])
    monkeypatch.setattr(beforefork, "native_threads", lambda: 1)
    seen = beforefork.Seen()
    seen.missing = {"TORCHINDUCTOR_CACHE_DIR": {"torch._inductor.runtime.cache_dir_utils"}, "RANK": {"somelib"},
                    "LOCAL_RANK": {"torchmetrics.utilities.prints"}}
    seen.set = {"TORCHINDUCTOR_CACHE_DIR": (None, "/tmp/torchinductor_u")}
    seen.checked = time.monotonic()
    assert seen.refusal({"TORCHINDUCTOR_CACHE_DIR": "/tmp/torchinductor_u", "LOCAL_RANK": "1"}) is None
    assert seen.refusal({"TORCHINDUCTOR_CACHE_DIR": "/mine"})[0] == "RANK"  # the user's own: the import saw none
    assert seen.refusal({"RANK": "1"})[0] == "RANK"


NAMES = textwrap.dedent('''
    import json, sys
    loader = globals().get("__loader__")
    print(json.dumps({"argv0": sys.argv[0], "file": __file__, "package": __package__, "spec": repr(__spec__),
                      "cached": globals().get("__cached__"), "loader": [type(loader).__name__,
                      getattr(loader, "name", None), getattr(loader, "path", None)],
                      "hook": sys.excepthook is sys.__excepthook__, "names": sorted(k for k in globals() if k.startswith("__"))}))
''')


def test_a_forked_rank_has_the_names_a_cold_start_gives_its_script(warm, tmp_path):
    """sys.argv[0] as the command line names it, __file__, __loader__, __package__, and Python's
    own excepthook: a forked rank once had the path runpy was handed, no loader, "" and ddp-up's hook."""
    (tmp_path / "names.py").write_text(NAMES)
    cold = subprocess.run([sys.executable, "-u", "names.py", "3"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    w = warm()
    assert w.ready(30), w.hello
    out, err = tmp_path / "out", tmp_path / "err"
    child = w.fork(0, ["names.py", "3"], {"ONLY_THE_RANK": "r"}, str(tmp_path), str(out), str(err))
    assert child is not None and child.wait(30) == 0, err.read_text()
    assert json.loads(out.read_text()) == json.loads(cold.stdout), (out.read_text(), cold.stdout)


def test_what_a_preload_prints_is_shown_once_on_the_jobs_stderr(tmp_path):
    """A cold start shows an import's banner or warning in every rank's output; warm, it went to
    the interpreter's log, unseen: it is shown once, bounded, when the interpreter says ready."""
    (tmp_path / "noisy.py").write_text("import sys\nprint('hello from noisy')\nprint('warn: old', file=sys.stderr)\n")
    (tmp_path / "flood.py").write_text("print('x' * 20000)\n")
    said = []
    for module in ("noisy", "flood", "json"):
        said.clear()
        w = Warm(sys.executable, {"PATH": os.environ["PATH"], "PYTHONPATH": str(tmp_path)}, str(tmp_path),
                 str(tmp_path / f"{module}.log"), (module,), base=(), report=said.append)
        try:
            assert w.ready(60), w.hello
        finally:
            w.reap(10)
        shown = [s for s in said if "the imports printed" in s]
        if module == "noisy":
            assert shown == ["ddp-up: warm start: the imports printed:\nhello from noisy\nwarn: old\n"], said
        elif module == "flood":
            assert len(shown) == 1 and "(first 8192 bytes; the rest in " in shown[0] and len(shown[0]) < 8500, said
        else:
            assert shown == [], said  # nothing printed: nothing said


def test_a_warm_interpreter_killed_under_its_ranks_says_so(warm, tmp_path):
    import signal as signals

    w = warm()
    assert w.ready(60), w.hello
    child, _, _ = fork(w, tmp_path, "import time\ntime.sleep(60)\n")
    os.kill(w.proc.pid, signals.SIGKILL)
    deadline = time.monotonic() + 20
    while w.died is None:
        assert time.monotonic() < deadline, "its death was not seen"
        time.sleep(0.05)
    assert w.died == f"its warm interpreter (pid {w.proc.pid}) was killed by SIGKILL while its ranks ran: their " \
                     "exit statuses are lost"
    os.kill(child.pid, signals.SIGKILL)
