"""The stack-dump hook the agent injects: registers the handler, and keeps a shadowed sitecustomize."""

import os
import signal
import subprocess
import sys

from orchestrator.node.local.procs import catches
from orchestrator.node.watch.stacks import DUMP_SIGNAL, hooks


def write_hook(where):
    """The attempt's hook with stack dumps on, as the agent writes it (its sitecustomize and the signal)."""
    for name, text in hooks(True).items():
        (where / name).write_text(text)


def test_hook_registers_the_dump_signal_and_chains_to_the_shadowed_sitecustomize(tmp_path):
    hooks, other = tmp_path / "hooks", tmp_path / "other"
    hooks.mkdir()
    other.mkdir()
    write_hook(hooks)
    (other / "sitecustomize.py").write_text("import os\nos.environ['OTHER_SITE'] = 'ran'\n")
    code = "import os, sys, time; print(os.environ.get('OTHER_SITE'), flush=True); time.sleep(30)"
    env = {**os.environ, "PYTHONPATH": f"{hooks}{os.pathsep}{other}"}
    p = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert p.stdout.readline() == b"ran\n"
        assert catches(p.pid, DUMP_SIGNAL)
        os.kill(p.pid, DUMP_SIGNAL)
        err = b""
        while b"(most recent call first)" not in err:
            err += p.stderr.read1(4096)
        assert p.poll() is None  # dumped, still running
    finally:
        p.kill()
        p.wait(5)


def test_a_process_without_the_hook_does_not_catch_it():
    # SIGINT as a terminal's job has it: a shell's background job (a CI step, `nohup ... &`) starts with
    # it ignored, and Python then installs no handler of its own
    p = subprocess.Popen([sys.executable, "-c", "import time; print(1, flush=True); time.sleep(30)"],
                         stdout=subprocess.PIPE, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        p.stdout.readline()
        assert not catches(p.pid, DUMP_SIGNAL)
        assert catches(p.pid, signal.SIGINT)  # Python's own KeyboardInterrupt handler
    finally:
        p.kill()
        p.wait(5)


import pytest  # noqa: E402


@pytest.mark.parametrize("script,ended", [
    ("print('done')", True),
    ("import sys; sys.exit(0)", True),
    ("import sys; sys.exit(3)", False),
    ("import sys; sys.exit('a message is a failure')", False),
    ("raise SystemExit(3)", None),  # None: run as a script file too, where the bare raise shows
    ("raise SystemExit", None),  # its code is not to be read: no clean end (fails closed)
    ("exit(3)", False),  # the builtins site makes: they raise SystemExit themselves
    ("quit(3)", False),
    ("exit()", True),
    ("import sys; sys.exit(False)", True),
    ("import sys; sys.exit(True)", False),
    ("raise RuntimeError('boom')", False),
    ("import os; os._exit(0)", False),  # no Python exit at all: no teardown to die in either
])
def test_a_rank_that_ended_its_script_cleanly_says_so_as_it_exits_and_only_then(tmp_path, script, ended):
    write_hook(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "RANK": "5"}
    env.pop("DDP_UP_RANK_PID", None)
    if ended is not None:
        subprocess.run([sys.executable, "-c", script], env=env, stderr=subprocess.DEVNULL, timeout=60)
        assert (tmp_path / "ended.5").exists() == ended
    (tmp_path / "ended.5").unlink(missing_ok=True)
    (tmp_path / "script.py").write_text(script + "\n")  # as torchrun starts a rank: python SCRIPT
    subprocess.run([sys.executable, str(tmp_path / "script.py")], env=env, stderr=subprocess.DEVNULL, timeout=60)
    assert (tmp_path / "ended.5").exists() == bool(ended)


def test_a_ranks_own_children_and_a_process_without_a_rank_leave_nothing(tmp_path):
    """A DataLoader's spawned worker runs the hook too, with the rank's RANK: it is not the rank."""
    write_hook(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "RANK": "2"}
    env.pop("DDP_UP_RANK_PID", None)
    child = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'print(1)'], check=True); sys.exit(3)"
    done = subprocess.run([sys.executable, "-c", child], env=env, stdout=subprocess.DEVNULL, timeout=60)
    assert done.returncode == 3 and not (tmp_path / "ended.2").exists()  # the child's clean end is not the rank's
    env.pop("RANK")
    subprocess.run([sys.executable, "-c", "print(1)"], env=env, stdout=subprocess.DEVNULL, timeout=60)
    assert list(tmp_path.glob("ended.*")) == []


@pytest.mark.parametrize("report,teardown", [
    ("exitcode  : -6 (pid: 11)", True),  # SIGABRT after the script's end: torch's threads at exit
    ("exitcode  : 3 (pid: 11)", False),  # a code of the rank's own: raise SystemExit(3), os._exit(3)
    ("exitcode  : 1 (pid: 11)", False),
    (None, False),  # the launcher named no rank: nothing excuses it
])
def test_the_teardown_rule_excuses_only_a_rank_killed_by_a_signal(report, teardown):
    from orchestrator.node.watch.teardown import died_in_teardown
    from orchestrator.node.watch.report import ReportReader

    reader = ReportReader()
    if report is not None:
        reader.feed(("=" * 60 + "\ntrain.py FAILED\n" + "-" * 60 + "\nFailures:\n  <NO_OTHER_FAILURES>\n" + "-" * 60 +
                     "\nRoot Cause (first observed failure):\n[0]:\n  time      : 2026-11-28_10:00:00\n"
                     "  host      : node1\n  rank      : 0 (local_rank: 0)\n  " + report + "\n" + "=" * 60 + "\n").encode())
    assert died_in_teardown(reader.parser) is teardown


@pytest.mark.parametrize("hooked", [True, False])
def test_a_rank_s_child_forked_under_rich_s_live_display_prints_instead_of_hanging(tmp_path, hooked):
    """Lightning's Rich bar, live in a rank (TTY_INTERACTIVE, as ddp-up sets it), and a DataLoader
    worker forked while Rich's refresh holds the console's lock: with the rank's hook the worker
    prints and ends; without it, it waits for ever (the script kills it after 5 s)."""
    from pathlib import Path
    write_hook(tmp_path)
    env = {**os.environ, "TTY_INTERACTIVE": "1", "TTY_COMPATIBLE": "1", "RANK": "0"}
    env["PYTHONPATH"] = str(tmp_path) if hooked else ""
    env.pop("DDP_UP_RANK_PID", None)
    script = Path(__file__).parents[1] / "scripts" / "rich_fork.py"
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, timeout=60)
    assert (b"CHILD ENDED" if hooked else b"CHILD HUNG") in done.stdout, done.stdout[-500:]


@pytest.mark.parametrize("hooked", [True, False])
def test_under_rich_s_live_display_a_rank_s_lines_go_whole_and_its_stderr_stays_stderr(tmp_path, hooked):
    """Rich folds each line it prints for a redirected stream at the console's width (COLUMNS), and
    sends the redirected stderr to stdout: with the rank's hook, the line is whole and the warning on
    stderr, as by hand; without it, neither (so the test can tell)."""
    from pathlib import Path
    write_hook(tmp_path)
    env = {**os.environ, "TTY_INTERACTIVE": "1", "TTY_COMPATIBLE": "1", "COLUMNS": "60", "RANK": "0"}
    env["PYTHONPATH"] = str(tmp_path) if hooked else ""
    env.pop("DDP_UP_RANK_PID", None)
    script = Path(__file__).parents[1] / "scripts" / "rich_lines.py"
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, timeout=60)
    whole, on_stderr = b"L" * 120 in done.stdout, b"a warning of the rank's" in done.stderr
    assert (whole, on_stderr) == ((True, True) if hooked else (False, False)), (done.stdout[-400:], done.stderr)
