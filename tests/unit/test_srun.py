"""Issue 16, the parts that need no Slurm: the step each node's agent runs in, and Slurm's word
for a step it ended."""

from orchestrator.job.reports import slurm_cancel
from orchestrator.remote.srun import srun_argv


def test_each_agent_is_one_task_on_its_node_sharing_the_allocation():
    argv = srun_argv("gpu-7", "exec env A=1 python3 -u -c x")
    assert argv[1:] == ["--overlap", "--nodes=1", "--ntasks=1", "--nodelist=gpu-7", "--unbuffered", "--quiet",
                        "--chdir=/", "--job-name=ddp-up", "bash", "-c", "exec env A=1 python3 -u -c x"]


def test_slurm_s_cancel_lines_name_what_it_did():
    assert slurm_cancel("slurmstepd-n2: error: *** STEP 41.3 ON n2 CANCELLED AT 2026-11-23T06:27:42 ***") == \
        "Slurm cancelled step 41.3 (scancel, or the allocation ended)"
    assert slurm_cancel("slurmstepd: error: *** JOB 41 ON n1 CANCELLED AT 2026-11-23T06:27:42 DUE TO TIME LIMIT ***") \
        == "Slurm cancelled job 41 due to time limit"
    assert slurm_cancel("a rank printing *** STEP 1.0 ON x CANCELLED AT soon") is None


def test_sbatch_options_run_to_the_cluster_file_or_a_double_dash():
    import pytest

    from orchestrator.errors import UsageError
    from orchestrator.plan.sbatch import batch_script, split_sbatch

    assert split_sbatch(["c.yaml", "t.py"]) == (None, ["c.yaml", "t.py"])
    assert split_sbatch(["--sbatch", "-N", "4", "--time=1:00:00", "c.yaml", "t.py", "--x"]) == (
        ["-N", "4", "--time=1:00:00"], ["c.yaml", "t.py", "--x"])
    assert split_sbatch(["--ranks", "0", "--sbatch", "-p", "gpu", "--", "t.py"]) == (["-p", "gpu"], ["--ranks", "0", "t.py"])
    with pytest.raises(UsageError, match="end sbatch's options with -- or the cluster file"):
        split_sbatch(["--sbatch", "-N4", "t.py"])
    script, held = batch_script(["--job-id", "J", "c.yaml", "t.py", "a b; rm -rf /"])
    assert not held and script.startswith("#!/bin/bash\n") and "--slurm --no-dashboard --job-id J c.yaml t.py 'a b; rm -rf /'" in script


def test_slurm_s_word_after_a_node_s_end_still_makes_it_the_root_cause():
    """slurmstepd's line comes on the step's stderr, which may arrive after the agent's Exited."""
    from orchestrator.node.protocol import wire
    from orchestrator.job.events import Message
    from tests.unit.fakejob import Harness

    h = Harness(2)
    cancel = "slurmstepd-h1: error: *** STEP 7.1 ON h1 CANCELLED AT 2026-11-23T06:27:42 ***"
    h.queue.at(1003.0, Message(1, wire.Exited(code=-15, signal="SIGTERM", stopped=True, reason="agent got SIGTERM")))
    h.queue.at(1003.1, h.lines(1, cancel, stream="node"))
    result = h.job.run()
    assert result.root_cause.node == 1
    assert result.root_cause.what == "Slurm cancelled step 7.1 (scancel, or the allocation ended)"


def test_a_rank_killed_by_slurm_s_signal_before_its_agent_acted_is_slurm_s_doing_too():
    """scancel signals every process of the step: a rank may die of it first, and its launcher
    report a failed rank (exit code -15), before the agent stops on its own SIGTERM."""
    from orchestrator.node.protocol import wire
    from orchestrator.job.events import Message
    from tests.unit.fakejob import Harness

    h = Harness(2)
    h.queue.at(1003.0, h.lines(1, "Root Cause (first observed failure):", "[0]:", "  rank      : 1 (local_rank: 0)",
                               "  exitcode  : -15 (pid: 8203) (SIGTERM)"))
    h.queue.at(1003.0, Message(1, wire.Exited(code=143, signal=None, stopped=False, reason=None)))
    h.queue.at(1003.1, h.lines(1, "slurmstepd-h1: error: *** STEP 7.1 ON h1 CANCELLED AT 2026-11-23T06:27:42 ***",
                               stream="node"))
    result = h.job.run()
    assert result.root_cause.node == 1 and result.root_cause.rank == 1
    assert result.root_cause.what == "Slurm cancelled step 7.1 (scancel, or the allocation ended)"


def test_slurm_s_word_before_the_ranks_signalled_end_is_reported_makes_that_end_slurm_s_too():
    """The other order, seen in the Slurm test: slurmstepd's line arrives first, then the node's
    launcher reports its rank killed by the step's SIGTERM."""
    from orchestrator.node.protocol import wire
    from orchestrator.job.events import Message
    from tests.unit.fakejob import Harness

    h = Harness(2)
    h.queue.at(1002.9, h.lines(1, "slurmstepd-h1: error: *** STEP 7.1 ON h1 CANCELLED AT 2026-11-23T06:27:42 ***",
                               stream="node"))
    h.queue.at(1003.0, h.lines(1, "Root Cause (first observed failure):", "[0]:", "  rank      : 1 (local_rank: 0)",
                               "  exitcode  : -15 (pid: 8203) (SIGTERM)"))
    h.queue.at(1003.0, Message(1, wire.Exited(code=143, signal=None, stopped=False, reason=None)))
    result = h.job.run()
    assert result.root_cause.node == 1 and result.root_cause.rank == 1
    assert result.root_cause.what == "Slurm cancelled step 7.1 (scancel, or the allocation ended)"


def test_the_batch_script_is_private_runs_this_ddp_up_and_goes_when_the_submit_fails(tmp_path, monkeypatch):
    """Issue 26, item 4: the script is 0600 (never through a planted link), runs the ddp-up that
    wrote it (this Python, this package: not whichever ddp-up is first on PATH in the batch job),
    and is removed when sbatch refuses it. A fake sbatch stands in for Slurm's here."""
    import os
    import stat
    import sys
    from pathlib import Path

    import pytest

    from orchestrator.errors import SetupError
    from orchestrator.plan.sbatch import submit

    fake = tmp_path / "bin" / "sbatch"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'sbatch: error: invalid partition' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    runs = tmp_path / "runs"
    with pytest.raises(SetupError, match="invalid partition"):
        submit(["-p", "nope"], ["c.yaml", "t.py"], "J1", str(runs))
    assert not (runs / "J1" / "sbatch.sh").exists()
    fake.write_text("#!/bin/sh\necho '4242;cluster'\n")
    (runs / "J2").mkdir(parents=True)
    os.symlink(tmp_path / "victim", runs / "J2" / "sbatch.sh")  # planted: replaced, never followed
    slurm_job, path = submit(["-N1"], ["c.yaml", "t.py"], "J2", str(runs))
    assert slurm_job == "4242" and not (tmp_path / "victim").exists()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and not Path(path).is_symlink()
    script = Path(path).read_text()
    assert sys.executable in script and str(Path(__file__).resolve().parents[2]) in script


def test_the_batch_script_holds_no_secret_argument_the_batch_job_reads_it_from_its_environment(tmp_path, monkeypatch):
    """Issue 26, item 4: `ddp-up --sbatch c.yaml t.py --token $HF_TOKEN` wrote the token into the
    batch script. An argument holding a secret value is a variable there, set in the environment
    sbatch passes on; the script, run by bash, still gives ddp-up every argument as it was."""
    import os
    import subprocess
    from pathlib import Path

    import pytest

    from orchestrator.errors import UsageError
    from orchestrator.plan.sbatch import submit

    fake = tmp_path / "bin" / "sbatch"
    fake.parent.mkdir()
    seen = tmp_path / "seen-env"
    fake.write_text(f"#!/bin/sh\nenv | grep '^DDP_UP_SBATCH_ARG_' > {seen}\necho 4244\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    argv = ["c.yaml", "t.py", "--token", "hf-secret-value", "--url=https://u:hf-secret-value@h/x", "it's plain"]
    _, path = submit(["-N1"], argv, "J3", str(tmp_path / "runs"), secrets=frozenset({"hf-secret-value"}))
    script = Path(path).read_text()
    assert "hf-secret-value" not in script and '"$DDP_UP_SBATCH_ARG_3"' in script
    assert seen.read_text().splitlines() == ["DDP_UP_SBATCH_ARG_3=hf-secret-value",
                                             "DDP_UP_SBATCH_ARG_4=--url=https://u:hf-secret-value@h/x"]
    words = script.splitlines()[-1].split(" ", 1)[1]  # the exec line's words, as bash reads them
    env = dict(os.environ, DDP_UP_SBATCH_ARG_3=argv[3], DDP_UP_SBATCH_ARG_4=argv[4])
    shown = subprocess.run(["bash", "-c", f"printf '%s\\n' {words}"], env=env, capture_output=True, text=True).stdout
    assert shown.splitlines()[-len(argv):] == argv
    with pytest.raises(UsageError, match="--export"):
        submit(["--export=NONE"], argv, "J4", str(tmp_path / "runs"), secrets=frozenset({"hf-secret-value"}))


def test_sbatch_learns_the_secrets_from_the_settings_file_as_the_batch_job_will(tmp_path, monkeypatch, capsys):
    import os
    from pathlib import Path

    from orchestrator.commands.up import main_up

    fake = tmp_path / "bin" / "sbatch"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 4245\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("HF_TOKEN", "hf-forwarded-secret")
    settings = tmp_path / "slurm.yaml"
    settings.write_text("forward_env: [HF_TOKEN]\nenv: {WANDB_API_KEY: wandb-file-secret}\n")
    runs = tmp_path / "runs"
    assert main_up(["--runs-dir", str(runs), "--job-id", "J5", "--sbatch", "-N1", str(settings), "t.py",
                    "--hf", "hf-forwarded-secret", "--wandb", "wandb-file-secret"]) == 0, capsys.readouterr()
    script = Path(runs / "J5" / "sbatch.sh").read_text()
    assert "hf-forwarded-secret" not in script and "wandb-file-secret" not in script, script
    assert '--hf "$DDP_UP_SBATCH_ARG_7" --wandb "$DDP_UP_SBATCH_ARG_9"' in script
