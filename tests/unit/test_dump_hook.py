"""The stack-dump hook the agent injects: registers the handler, and keeps a shadowed sitecustomize."""

import os
import signal
import subprocess
import sys

from orchestrator.node.procs import catches
from orchestrator.node.stacks import DUMP_HOOK, DUMP_SIGNAL


def test_hook_registers_the_dump_signal_and_chains_to_the_shadowed_sitecustomize(tmp_path):
    hooks, other = tmp_path / "hooks", tmp_path / "other"
    hooks.mkdir()
    other.mkdir()
    (hooks / "sitecustomize.py").write_text(DUMP_HOOK)
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
