"""The messages a newcomer meets first, word for word: errors keep their lines, misplaced keys and
other launchers' words point to ours, durations take units everywhere, a mistyped option names
the near one, every command lists its exit statuses, and a piped table keeps its columns."""

from __future__ import annotations

import textwrap

import pytest

from orchestrator.config.clusterfile import parse_cluster
from orchestrator.commands.attach import attach_parser, logs_parser, ls_parser, main_ls
from orchestrator.commands.check import check_parser
from orchestrator.commands.common import report
from orchestrator.commands.kill import kill_parser, main_kill
from orchestrator.commands.up import main_up, up_parser
from orchestrator.errors import ConfigError, NodeProblem, SetupError
from orchestrator.node.launchers.container import Box
from orchestrator.node.launchers.image import check_mounts


def test_an_error_of_several_nodes_keeps_one_node_a_line_and_fix_on_its_own(capsys):
    error = SetupError([NodeProblem("local-a", "script trian.py not found in /w", "copy it to this node"),
                        NodeProblem("local-b", "script trian.py not found in /w\x1b[2J", "copy it to this node")])
    assert report("ddp-up", error) == 3
    assert capsys.readouterr().err.splitlines() == [
        "ddp-up: 2 node(s) not ready; nothing was started:",
        "  local-a: script trian.py not found in /w",
        "    fix: copy it to this node",
        "  local-b: script trian.py not found in /w",  # each line still cleaned: no escape reaches the terminal
        "    fix: copy it to this node"]


def test_a_script_given_alone_is_said_not_to_be_a_cluster_file(capsys):
    assert main_up(["train.py"]) == 2
    err = capsys.readouterr().err
    assert "ddp-up: train.py is not a cluster file: ddp-up CLUSTER.yaml train.py [ARGS...]" in err
    assert "missing SCRIPT" not in err


def test_ddp_kill_without_nodes_says_so_once(capsys):
    assert main_kill([]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "ddp-kill: which nodes? name a cluster file (CLUSTER.yaml), or give them with --hostfile FILE, " \
                  "-H HOST:N,... or --slurm"
    assert err.count("ddp-kill") == 1


def load(text: str):
    return parse_cluster(textwrap.dedent(text), "c.yaml")


@pytest.mark.parametrize("text, message", [
    ("nodes: [{host: a}]\nuser: me\n", "c.yaml:2: user: unknown key; `user` belongs under `ssh:` (for every node) "
                                       "or on a node"),
    ("nodes: [{host: a}]\nport: 2222\n", "c.yaml:2: port: unknown key; `port` belongs under `ssh:`"),
    ("nodes: [{host: a}]\nidentity_file: ~/.ssh/k\n", "c.yaml:2: identity_file: unknown key; `identity_file` "
                                                      "belongs under `ssh:`"),
    ("nodes: [{host: a}]\nnproc_per_node: 8\n", "c.yaml:2: nproc_per_node: unknown key; `nproc_per_node` is "
                                                "`gpus:` here"),
    ("nodes: [{host: a, nproc_per_node: 8}]\n", "c.yaml:1: nodes[0].nproc_per_node: unknown key; `nproc_per_node` "
                                                "is `gpus:` here"),
    ("hosts: [a, b]\n", "c.yaml:1: hosts: unknown key; `hosts` is `nodes:` here"),
    ("nodes: [{host: a}]\nmaster_addr: 10.0.0.1\n", "c.yaml:2: master_addr: unknown key; `master_addr` is "
                                                    "`master: {addr: ...}` here"),
    ("nodes: [{host: a}]\nmaster_port: 29500\n", "`master_port` is `master: {port: ...}` here"),
    ("nodes: [{host: a}]\nhost: b\n", "c.yaml:2: host: unknown key; `host` belongs on a node"),
    ("nodes: [{host: a}]\nstop_grase: 5\n", "c.yaml:2: stop_grase: unknown key; did you mean `stop_grace`?"),
])
def test_a_misplaced_key_or_another_launchers_word_says_where_it_goes(text, message):
    with pytest.raises(ConfigError) as info:
        load(text)
    assert message in str(info.value), str(info.value)


@pytest.mark.parametrize("key", ["hang_timeout", "orphan_timeout", "stop_grace", "restart_delay", "retention"])
def test_every_duration_takes_units(key):
    config = load(f"nodes: [{{host: a, gpus: 1}}]\n{key}: 5m\n")
    assert getattr(config, key) == 300.0
    assert getattr(load(f"nodes: [{{host: a, gpus: 1}}]\n{key}: 90\n"), key) == 90.0
    with pytest.raises(ConfigError, match=f"{key}: must be a number of seconds .*a duration such as 90s, 5m"):
        load(f"nodes: [{{host: a, gpus: 1}}]\n{key}: 5 minutes\n")


def test_the_connect_timeout_and_the_command_lines_hang_timeout_take_units_too(capsys):
    assert load("nodes: [{host: a, gpus: 1}]\nssh: {connect_timeout: 1m}\n").nodes[0].ssh.connect_timeout == 60.0
    assert up_parser().parse_args(["--hang-timeout", "5m", "c.yaml", "t.py"]).hang_timeout == 300.0


@pytest.mark.parametrize("parser, typo, near", [(up_parser, "--dryrun", "--dry-run"), (kill_parser, "--prge", "--purge"),
                                                (check_parser, "--colective", "--collective"),
                                                (ls_parser, "--jsn", "--json")])
def test_an_unknown_option_names_the_near_one(parser, typo, near, capsys):
    with pytest.raises(SystemExit) as info:
        parser().parse_args([typo, "c.yaml"])
    assert info.value.code == 2
    assert f"unrecognized arguments: {typo} (did you mean {near}?)" in capsys.readouterr().err


@pytest.mark.parametrize("parser, words", [
    (up_parser, ["0 ok", "1 job failed", "2 bad config or usage", "3 a node could not be set up", "70 internal error",
                 "128+N"]),
    (kill_parser, ["0 every node answered", "1 a node could not be reached", "2 bad cluster file", "128+N"]),
    (check_parser, ["0 every node is ready", "1 --collective or --gpus could not run", "3 a node is not ready", "128+N"]),
    (ls_parser, ["0 listed", "3 a node could not be asked", "128+N"]),
    (lambda: attach_parser(), ["the job's own status", "3 no such job", "128+N"]),
    (lambda: logs_parser(), ["0 printed", "3 no such job", "128+N"])])
def test_every_commands_help_lists_its_exit_statuses(parser, words):
    text = " ".join(parser().format_help().split())
    assert "Exit status: " in text and all(w in text for w in words), text


def test_sbatch_is_in_ddp_ups_help():
    assert "--sbatch [SBATCH OPTIONS] submit the run as a Slurm batch job" in " ".join(up_parser().format_help().split())


def test_ddp_ls_with_no_jobs_prints_one_line_and_no_empty_table(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # a state root of its own: no job of anyone else's
    c = tmp_path / "c.yaml"
    c.write_text("transport: local\nnodes: [{host: a, gpus: 1}]\n")
    assert main_ls([str(c)]) == 0
    assert capsys.readouterr().out.strip() == "ddp-ls: no detached jobs on these nodes (ddp-up --detach starts one)"


TAGS = {"DDP_UP_JOB": "j1", "DDP_UP_NODE": "0"}


def test_a_mount_of_the_workdir_onto_itself_is_dropped_and_another_source_there_is_refused(tmp_path):
    conf = {"runtime": "podman", "image": "i", "mounts": [f"{tmp_path}:{tmp_path}", f"{tmp_path}/"]}
    box = Box(conf, TAGS, str(tmp_path))
    assert [a for a in box.run_argv(["true"]) if a.startswith("--volume")] == [f"--volume={tmp_path}:{tmp_path}"]
    assert check_mounts(box) is None
    other = tmp_path / "data"
    other.mkdir()
    failed = check_mounts(Box(dict(conf, mounts=[f"{other}:{tmp_path}:ro"]), TAGS, str(tmp_path)))
    assert failed.what == f"container.mounts[0]: {other} would be mounted at {tmp_path}, where ddp-up mounts the " \
                          "job's workdir"
    assert failed.fix == "mount it at another path, or set `workdir:` to it"


def test_a_rank_killed_by_a_signal_says_so_and_a_failed_node_names_its_ranks_own_codes():
    from orchestrator.node.protocol import policy
    from orchestrator.diagnose.outcome import Failure
    from orchestrator.job.reports import ranks_ended

    assert policy.exit_words(-9) == "was killed by SIGKILL" and policy.exit_words(3) == "exited with code 3"
    assert policy.exit_words(None, "SIGTERM") == "was killed by SIGTERM" and policy.exit_words(-99).endswith("signal 99")
    own = [Failure(1, "b", 5, 3, "rank 5 exited with code 3", 10.0), Failure(1, "b", 4, -9, "rank 4 was killed by SIGKILL", 11.0)]
    assert ranks_ended(own, "launcher exited with code 1") == \
        "rank 5 exited with code 3 (+1 more rank; launcher exited with code 1)"
    assert ranks_ended(own[1:], "launcher exited with code 1") == "rank 4 was killed by SIGKILL (launcher exited with code 1)"


@pytest.mark.parametrize("name", ["ſigusr1", "ınt", "SIGUSR1\u0131", "usr１"])
def test_a_signal_name_matches_in_ascii_only(name):
    from orchestrator.config.cluster import job_signal

    assert job_signal(name) is None and job_signal("usr1") == "SIGUSR1" and job_signal("int") == "SIGINT"


def test_a_switch_or_a_number_named_like_a_secret_is_not_masked_everywhere():
    """TOKENIZERS_PARALLELISM (every HF Trainer user sets it) matches *TOKEN*: its "false" was
    masked in every line ("this warning may be a *** positive")."""
    from orchestrator.config.clusterfile import parse_cluster

    config = parse_cluster("nodes: [{host: a, gpus: 1}]\nenv: {TOKENIZERS_PARALLELISM: 'false', MAX_TOKENS: '4096', "
                           "HF_TOKEN: hf_abcdef123}\n", "c.yaml")
    assert config.secret_values == frozenset({"hf_abcdef123"})
