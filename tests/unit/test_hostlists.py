import re

import pytest

from orchestrator.commands.common import cluster_and_script
from orchestrator.commands.up import split_argv
from orchestrator.config.clusterfile import parse_cluster
from orchestrator.config.cluster import NodeSource
from orchestrator.errors import ConfigError, UsageError
from orchestrator.config.hostlists import expand_hostlist, parse_host_list, parse_hostfile, slurm_nodes

HOSTFILE = """\
# DeepSpeed / MPI style
gpu-a slots=8
gpu-b   slots=4 max_slots=8   # an MPI upper bound is ignored
gpu-c
"""


def test_hostfile_lines_become_nodes():
    assert parse_hostfile(HOSTFILE, "hosts") == [{"host": "gpu-a", "gpus": 8}, {"host": "gpu-b", "gpus": 4},
                                                 {"host": "gpu-c", "gpus": 1}]


@pytest.mark.parametrize("text,message", [
    ("a slots=8\nb slots=x\n", "hosts:2: slots: slots must be an integer from 1 to 4096, got 'x'"),
    ("a slots=0\n", "hosts:1: slots: slots must be an integer from 1 to 4096, got '0'"),
    ("a gpus=8\n", "hosts:1: expected `HOST slots=N`, got 'a gpus=8'"),
    ("# nothing\n\n", "hosts: no hosts in the hostfile (expected lines like `gpu-a slots=8`)"),
])
def test_bad_hostfiles_name_the_line(text, message):
    with pytest.raises(ConfigError) as info:
        parse_hostfile(text, "hosts")
    assert str(info.value) == message


def test_horovod_host_list():
    assert parse_host_list("gpu-a:4, gpu-b:2,gpu-c") == [{"host": "gpu-a", "gpus": 4}, {"host": "gpu-b", "gpus": 2},
                                                        {"host": "gpu-c", "gpus": 1}]
    with pytest.raises(UsageError, match="slots must be an integer from 1 to 4096, got 'four'"):
        parse_host_list("gpu-a:four")
    with pytest.raises(UsageError, match="expected HOST:N"):
        parse_host_list("gpu-a:4,:2")


@pytest.mark.parametrize("spec,hosts", [
    ("gpu[01-03,07]", ["gpu01", "gpu02", "gpu03", "gpu07"]),
    ("a1,b[8-10],c", ["a1", "b8", "b9", "b10", "c"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("node009", ["node009"]),
])
def test_slurm_host_lists_expand(spec, hosts):
    assert expand_hostlist(spec) == hosts


@pytest.mark.parametrize("spec", ["gpu[01-03", "gpu[3-1]", "gpu[a-b]", "gpu]1["])
def test_bad_slurm_host_lists_are_refused(spec):
    with pytest.raises(UsageError):
        expand_hostlist(spec)


def test_slurm_allocation_becomes_nodes_gpus_and_port():
    env = {"SLURM_JOB_ID": "4812345", "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_GPUS_ON_NODE": "8"}
    assert slurm_nodes(env) == ([{"host": "gpu01", "gpus": 8}, {"host": "gpu02", "gpus": 8}], 15000 + 2345)
    env = {"SLURM_JOBID": "77", "SLURM_NODELIST": "n1", "SLURM_GPUS_PER_NODE": "a100:4"}
    assert slurm_nodes(env) == ([{"host": "n1", "gpus": 4}], 15077)
    env = {"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "n1", "SLURM_NTASKS_PER_NODE": "2(x3)"}
    assert slurm_nodes(env)[0] == [{"host": "n1", "gpus": 2}]
    assert slurm_nodes({"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "n1"})[0] == [{"host": "n1"}]  # no count
    with pytest.raises(UsageError, match="not inside a Slurm allocation"):
        slurm_nodes({})


@pytest.mark.parametrize("key, value", [("SLURM_GPUS_ON_NODE", "99999999999999"), ("SLURM_GPUS_ON_NODE", "\u0663"),
                                        ("SLURM_GPUS_PER_NODE", "a100:-1"), ("SLURM_NTASKS_PER_NODE", "lots")])
def test_a_slurm_count_that_is_not_one_is_refused_where_it_enters(key, value):
    """Issue 26, item 8: Slurm's counts are checked where they enter (a 14-digit count, or
    another script's digits, was taken for a process count)."""
    with pytest.raises(UsageError, match=f"--slurm: {key}=.* is not a count of processes per node"):
        slurm_nodes({"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "n1", key: value})


def test_under_slurm_the_settings_files_gpus_wins_where_the_allocation_gives_no_count():
    """Issue 26, item 8: `gpus: 1` in the settings file was ignored (auto won, and refused a CPU node)."""
    nodes, port = slurm_nodes({"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "n[1-2]"})
    source = NodeSource("--slurm", "", nodes, master_port=port, transport="srun")
    assert [n.gpus for n in parse_cluster("gpus: 1\n", "s.yaml", source).nodes] == [1, 1]
    assert [n.gpus for n in parse_cluster("python: python3\n", "s.yaml", source).nodes] == [None, None]  # auto
    counted, _ = slurm_nodes({"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "n1", "SLURM_GPUS_ON_NODE": "4"})
    assert parse_cluster("gpus: 1\n", "s.yaml", NodeSource("--slurm", "", counted)).nodes[0].gpus == 4


def test_nodes_from_a_source_take_the_cluster_files_other_settings():
    source = NodeSource("--slurm", "", [{"host": "n1", "gpus": 2}, {"host": "n2", "gpus": 2}], master_port=15077)
    cfg = parse_cluster("ssh: {user: me}\nworkdir: /w\n", "c.yaml", source)
    assert [(n.host, n.gpus, n.ssh.user, n.workdir) for n in cfg.nodes] == [("n1", 2, "me", "/w"), ("n2", 2, "me", "/w")]
    assert cfg.master_port == 15077 and cfg.master_addr == "n1"
    assert parse_cluster("master: {port: 29500}\n", "c.yaml", source).master_port == 29500  # the file wins
    assert parse_cluster("", "--slurm", source).nodes[1].host == "n2"  # no cluster file at all
    with pytest.raises(ConfigError, match=r"c.yaml:1: nodes: the nodes come from --slurm: remove `nodes:` here"):
        parse_cluster("nodes: [{host: x, gpus: 1}]\n", "c.yaml", source)


def test_the_cluster_file_is_optional_after_a_node_option():
    assert split_argv(["-H", "a:1", "train.py", "--lr", "1"]) == (["-H", "a:1", "train.py"], ["--lr", "1"])
    assert split_argv(["--hostfile", "h", "c.yaml", "train.py", "x"]) == (["--hostfile", "h", "c.yaml", "train.py"],
                                                                          ["x"])
    assert split_argv(["c.yaml", "train.py", "-H", "x"]) == (["c.yaml", "train.py"], ["-H", "x"])  # script's own
    assert cluster_and_script("train.py", None, has_source=True) == (None, "train.py")
    assert cluster_and_script("c.yaml", None, has_source=True) == ("c.yaml", None)
    assert cluster_and_script("c.yaml", "t.py", has_source=False) == ("c.yaml", "t.py")


@pytest.mark.parametrize("argv, ours, theirs", [
    (["--hostfile=h", "train.py", "--epochs", "3"], ["--hostfile=h", "train.py"], ["--epochs", "3"]),
    (["-Ha:1,b:1", "train.py", "--lr", "1"], ["-Ha:1,b:1", "train.py"], ["--lr", "1"]),
    (["-H=a:1", "train.py", "x"], ["-H=a:1", "train.py"], ["x"]),
    (["--hostfile=h", "c.yaml", "train.py", "y"], ["--hostfile=h", "c.yaml", "train.py"], ["y"]),
    (["c.yaml", "train.py", "--detach", "--sbatch"], ["c.yaml", "train.py"], ["--detach", "--sbatch"]),
    (["--job-id=J", "c.yaml", "train.py", "--job-id", "K"], ["--job-id=J", "c.yaml", "train.py"], ["--job-id", "K"]),
])
def test_every_form_of_an_option_and_what_follows_the_script_is_the_scripts(argv, ours, theirs):
    """Issue 26: `--hostfile=FILE` and `-Ha:1` name nodes as their two-word forms do, and an
    option after the script (`--detach`, `--sbatch`) is the script's argument."""
    assert split_argv(argv) == (ours, theirs)


def test_sbatch_after_the_script_is_the_scripts(tmp_path, capsys):
    from orchestrator.commands.up import main_up, options_end
    from orchestrator.plan.sbatch import split_sbatch

    assert options_end(["--ranks", "0", "--sbatch", "-p", "gpu", "c.yaml"]) == 4
    assert options_end(["c.yaml", "t.py", "--sbatch"]) == 0
    argv = ["c.yaml", "t.py", "--sbatch", "-N4"]
    assert split_sbatch(argv, options_end(argv)) == (None, argv)
    c = tmp_path / "c.yaml"
    c.write_text("nodes: [{host: 192.0.2.1, gpus: 1}]\n")
    assert main_up(["--dry-run", str(c), "t.py", "--sbatch", "--detach"]) == 0  # nothing submitted, nothing detached
    out = capsys.readouterr().out
    assert "t.py --sbatch --detach" in out, out


def test_slurm_allocation_plans_every_node(monkeypatch, capsys):
    from orchestrator.commands.up import main_up

    for key, value in {"SLURM_JOB_ID": "4812345", "SLURM_JOB_NODELIST": "gpu[01-03]", "SLURM_GPUS_ON_NODE": "4"}.items():
        monkeypatch.setenv(key, value)
    assert main_up(["--slurm", "--dry-run", "train.py", "--lr", "1"]) == 0
    out = capsys.readouterr().out
    assert "3 node(s), world size 12, master gpu01:17345" in out
    for rank, host in enumerate(["gpu01", "gpu02", "gpu03"]):
        assert re.search(rf"# node {rank} {host} .*\n.*--nnodes=3 --nproc-per-node=4 --node-rank={rank} "
                         r"--master-addr=gpu01 --master-port=17345 .*train.py --lr 1", out), out


@pytest.mark.parametrize("spec, nodes", [
    ("[fe80::1]:2,[fe80::2]", [{"host": "fe80::1", "gpus": 2}, {"host": "fe80::2", "gpus": 1}]),
    ("gpu-a:8,10.0.0.2:4", [{"host": "gpu-a", "gpus": 8}, {"host": "10.0.0.2", "gpus": 4}]),
])
def test_ipv6_addresses_go_in_brackets(spec, nodes):
    """Issue 26, item 8: `[fe80::1]:2` named the host `[fe80::1]`, brackets and all."""
    assert parse_host_list(spec) == nodes


@pytest.mark.parametrize("spec, problem", [
    ("fe80::1:2", "write an IPv6 address in brackets"),  # was read as fe80::1 with 2 slots
    ("a b:1", "the host 'a b' has a space or a control character"),
    ("-oProxyCommand=x:1", "starts with '-'"),
    ("[fe80::1:2", "expected HOST:N"),
])
def test_a_host_list_that_could_be_misread_is_refused(spec, problem):
    with pytest.raises(UsageError, match=re.escape(problem)):
        parse_host_list(spec)
