import sys
import textwrap

import pytest

from orchestrator.config.clusterfile import parse_cluster
from orchestrator.errors import ConfigError

GOOD = """\
nodes:
  - host: 10.0.0.1
    gpus: 8
  - host: gpu-b
    gpus: 4
    user: root
    addr: 10.0.0.2
    env: {A: node}
ssh:
  user: ubuntu
  port: 2222
  identity_file: ~/.ssh/id_ed25519
  connect_timeout: 3
python: /usr/bin/python3
workdir: ~/project
env: {NCCL_DEBUG: INFO, A: top, N: 3, B: true}
master:
  port: 29400
"""


def test_good_file_applies_defaults_and_overrides(tmp_path):
    cfg = parse_cluster(GOOD, str(tmp_path / "c.yaml"))
    a, b = cfg.nodes
    assert (a.rank, a.host, a.gpus, a.addr, a.ssh.user, a.ssh.port) == (0, "10.0.0.1", 8, "10.0.0.1", "ubuntu", 2222)
    assert (b.rank, b.addr, b.ssh.user, b.workdir, b.python) == (1, "10.0.0.2", "root", "~/project", "/usr/bin/python3")
    assert dict(a.env) == {"NCCL_DEBUG": "INFO", "A": "top", "N": "3", "B": "1"}
    assert dict(b.env)["A"] == "node"
    assert a.ssh.identity_file.endswith("/.ssh/id_ed25519") and not a.ssh.identity_file.startswith("~")
    assert (cfg.master_addr, cfg.master_port, cfg.auto_gpus) == ("10.0.0.1", 29400, [])
    assert (cfg.orphan_timeout, cfg.stop_grace) == (30.0, 10.0)


def test_master_port_defaults_to_auto_and_local_defaults():
    cfg = parse_cluster("transport: local\nnodes: [{host: a, gpus: 1}, {host: b, gpus: 2}]\n")
    assert cfg.master_port is None and cfg.master_addr == "127.0.0.1"
    assert cfg.nodes[0].transport == "local"
    assert cfg.nodes[0].python == sys.executable  # a local node uses the controller's interpreter


def test_relative_key_paths_resolve_beside_the_cluster_file(tmp_path):
    cfg = parse_cluster("ssh: {identity_file: keys/id}\nnodes: [{host: a, gpus: 1}]\n", str(tmp_path / "c.yaml"))
    assert cfg.nodes[0].ssh.identity_file == str(tmp_path / "keys" / "id")


def test_gpus_auto_is_resolved_per_node_before_planning():
    cfg = parse_cluster("gpus: auto\nnodes: [{host: a}, {host: b, gpus: 2}, {host: c}]\n", "c.yaml")
    assert [n.host for n in cfg.auto_gpus] == ["a", "c"]
    resolved = cfg.resolve_gpus({0: 8, 2: 4})
    assert [n.gpus for n in resolved.nodes] == [8, 2, 4] and resolved.auto_gpus == []
    assert [n.gpus for n in cfg.nodes] == [None, 2, None]  # the parsed config is left as it was


# Each broken file and the exact message a user sees (file:line: key: what is wrong).
BROKEN = [
    ("", "c.yaml: the cluster file is empty; it needs at least a `nodes:` list"),
    ("nodes: [", "c.yaml:1: invalid YAML: expected the node content, but found '<stream end>'"),
    ("ssh: {user: x}\n", "c.yaml:1: nodes: missing: list the nodes, e.g. `nodes: [{host: gpu-a, gpus: 8}]`"),
    ("nodes: []\n", "c.yaml:1: nodes: must be a non-empty list of nodes"),
    ("nodes:\n  - host: a\n    gpus: 1\nnodez: 3\n", "c.yaml:4: nodez: unknown key; did you mean `nodes`?"),
    ("nodes:\n  - host: a\n    gpu: 2\n", "c.yaml:3: nodes[0].gpu: unknown key; did you mean `gpus`?"),
    ("nodes:\n  - host: a\n    gpus: 1\n  - host: b\n    gpus: -2\n",
     "c.yaml:5: nodes[1].gpus: must be an integer between 1 and 1024 or `auto`, got -2"),
    ("nodes:\n  - host: a\n    gpus: two\n", "c.yaml:3: nodes[0].gpus: must be an integer between 1 and 1024 or `auto`, got 'two'"),
    ("nodes:\n  - host: a\n    gpus: true\n", "c.yaml:3: nodes[0].gpus: must be an integer between 1 and 1024 or `auto`, got True"),
    ("nodes:\n  - gpus: 1\n", "c.yaml:2: nodes[0]: missing `host:` (SSH target: address, DNS name or ~/.ssh/config alias)"),
    ("nodes:\n  - host: a\n", "c.yaml:2: nodes[0]: missing `gpus:` (number of processes to start on this node, >= 1, or `auto`)"),
    ("nodes:\n  - host: a\n    gpus: 1\n  - host: a\n    gpus: 2\n",
     "c.yaml:4: nodes[1].host: duplicate of nodes[0] (line 2): list each node once and set `gpus:` to its process count"),
    ("nodes: [{host: a, gpus: 1}]\nmaster: {port: 70000}\n",
     "c.yaml:2: master.port: must be an integer between 1 and 65535 or `auto`, got 70000"),
    ("nodes: [{host: a, gpus: 1}]\nmaster: {port: 29500, adr: x}\n", "c.yaml:2: master.adr: unknown key; did you mean `addr`?"),
    ("nodes: [{host: a, gpus: 1}]\nssh: {port: 0}\n", "c.yaml:2: ssh.port: must be an integer between 1 and 65535, got 0"),
    ("nodes: [{host: a, gpus: 1}]\nenv: {1BAD: x}\n", "c.yaml:2: env.1BAD: is not a valid environment variable name"),
    ("nodes: [{host: a, gpus: 1}]\nenv: {A: [1]}\n", "c.yaml:2: env.A: must be a string or number"),
    ("nodes: [{host: a, gpus: 1}]\nenv: [A]\n", "c.yaml:2: env: must be a mapping of NAME: value"),
    ("nodes: [{host: a, gpus: 1}]\norphan_timeout: 0\n", "c.yaml:2: orphan_timeout: must be a number of seconds > 0, or a duration such as 90s, 5m, 12h or 7d, got 0"),
    ("nodes: [{host: a, gpus: 1}]\nhang_timeout: -5\n", "c.yaml:2: hang_timeout: must be a number of seconds > 0, or a duration such as 90s, 5m, 12h or 7d, got -5"),
    ("nodes: [{host: a, gpus: 1}]\nlauncher: mpirun\n",
     "c.yaml:2: launcher: must be one of `torchrun`, `legacy`, `none`, `accelerate`, got 'mpirun'"),
    ("nodes: [{host: a, gpus: 1, transport: rsh}]\n", "c.yaml:1: nodes[0].transport: must be `ssh`, `srun` (inside a Slurm allocation) or `local`, got 'rsh'"),
    ("nodes:\n  - host: a\n    gpus: 1\n    gpus: 2\n", "c.yaml:4: nodes[0].gpus: duplicate key (first set on line 3)"),
    ("nodes: 3\n", "c.yaml:1: nodes: must be a non-empty list of nodes"),
    ("- a\n- b\n", "c.yaml:1: must be a mapping, got a list"),
    ("nodes:\n  - host: [a]\n    gpus: 1\n", "c.yaml:2: nodes[0].host: must be a non-empty string, got a list"),
]


@pytest.mark.parametrize("text,message", BROKEN, ids=[m.split(": ", 1)[1][:40] for _, m in BROKEN])
def test_broken_files_name_line_and_key(text, message):
    with pytest.raises(ConfigError) as info:
        parse_cluster(textwrap.dedent(text), "c.yaml")
    assert str(info.value) == message
    assert info.value.exit_code == 2


def test_unreadable_file(tmp_path):
    from orchestrator.config.clusterfile import load_cluster

    with pytest.raises(ConfigError, match="cannot read cluster file: No such file or directory"):
        load_cluster(str(tmp_path / "missing.yaml"))


def test_ssh_config_aliases_give_way_to_their_hostname_where_other_nodes_need_an_address(tmp_path):
    (tmp_path / "my_ssh_config").write_text("")
    cfg = parse_cluster("ssh: {config_file: my_ssh_config}\nnodes: [{host: a, gpus: 1}, {host: b, gpus: 1, addr: x},"
                        " {host: c, gpus: 1}]\n", str(tmp_path / "c.yaml"))
    assert cfg.nodes[0].ssh.config_file == str(tmp_path / "my_ssh_config")  # beside the cluster file
    assert cfg.nodes[0].ssh.port is None  # unset: the SSH config's Port, else 22
    real = cfg.with_addresses({"a": "10.0.0.1", "b": "10.0.0.2"})
    assert [n.addr for n in real.nodes] == ["10.0.0.1", "x", "c"]  # an explicit addr is kept
    assert real.master_addr == "10.0.0.1" and [n.host for n in real.nodes] == ["a", "b", "c"]


def test_env_file_then_forwarded_then_env_and_secrets_are_masked(tmp_path):
    (tmp_path / "team.env").write_text('# comment\nexport A="from file"\nB=file\nAPI_KEY=k-123456\n')
    text = ("env_file: team.env\nforward_env: [HF_TOKEN, 'WANDB_*']\nsecrets: [MY_PASS*]\nenv: {B: top}\n"
            "nodes: [{host: a, gpus: 1, env: {MY_PASSPHRASE: swordfish}}]\n")
    environ = {"HF_TOKEN": "hf_abcdef", "WANDB_PROJECT": "p", "WANDB_MODE": "offline", "HOME": "/root"}
    cfg = parse_cluster(text, str(tmp_path / "c.yaml"), environ=environ)
    assert dict(cfg.nodes[0].env) == {"A": "from file", "B": "top", "API_KEY": "k-123456", "HF_TOKEN": "hf_abcdef",
                                      "WANDB_PROJECT": "p", "WANDB_MODE": "offline", "MY_PASSPHRASE": "swordfish"}
    assert cfg.secret_values == {"k-123456", "hf_abcdef", "swordfish"}  # *_KEY and *TOKEN* by default


@pytest.mark.parametrize("name", ["PRIVATE_KEY_PEM", "APIKEY", "DB_PASS", "db_password", "MY_AUTH", "AUTH_HEADER",
                                  "GCP_CREDENTIAL_FILE", "Some_Secret", "hf_token", "SSH_KEYPHRASE"])
def test_any_name_holding_a_secret_word_is_masked_by_default(name):
    cfg = parse_cluster(f"env: {{{name}: v4lue-0f-it, PLAIN: v4lue-shown}}\nnodes: [{{host: a, gpus: 1}}]\n")
    assert cfg.secret_values == {"v4lue-0f-it"}


def test_without_an_environment_forward_env_is_checked_for_form_only():
    """ddp-kill loads the cluster file too, and must not need the job's tokens in its shell."""
    cfg = parse_cluster("forward_env: [HF_TOKEN]\nnodes: [{host: a, gpus: 1}]\n", "c.yaml", environ=None)
    assert "HF_TOKEN" not in cfg.nodes[0].env
    with pytest.raises(ConfigError, match="must be a list of variable names"):
        parse_cluster("forward_env: HF_TOKEN\nnodes: [{host: a, gpus: 1}]\n", "c.yaml", environ=None)


@pytest.mark.parametrize("text,message", [
    ("forward_env: [HF_TOKEN]\n", "c.yaml:1: forward_env: HF_TOKEN is not set in this environment"),
    ("forward_env: ['*']\n", "c.yaml:1: forward_env: refusing to forward the whole environment"),
    ("forward_env: HF_TOKEN\n", "c.yaml:1: forward_env: must be a list of variable names or globs"),
    ("env_file: nope.env\n", "c.yaml:1: env_file: cannot read"),
])
def test_bad_environment_settings(tmp_path, text, message):
    with pytest.raises(ConfigError) as info:
        parse_cluster(text + "nodes: [{host: a, gpus: 1}]\n", "c.yaml", environ={})
    assert str(info.value).startswith(message)


def test_bad_env_file_names_its_line(tmp_path):
    (tmp_path / "x.env").write_text("A=1\nthis is not an assignment\n")
    with pytest.raises(ConfigError) as info:
        parse_cluster("env_file: x.env\nnodes: [{host: a, gpus: 1}]\n", str(tmp_path / "c.yaml"))
    assert str(info.value).startswith(f"{tmp_path}/x.env:2: expected NAME=value")
    assert "this is not" not in str(info.value)  # the line is not echoed: it may hold a secret


def test_setup_is_a_command_or_a_list_and_a_node_replaces_the_top_level():
    cfg = parse_cluster("setup: source ~/venv/bin/activate\nnodes: [{host: a, gpus: 1},"
                        " {host: b, gpus: 1, setup: [module load cuda, 'export X=1']}]\n")
    assert [n.setup for n in cfg.nodes] == [("source ~/venv/bin/activate",), ("module load cuda", "export X=1")]
    with pytest.raises(ConfigError, match="setup: must be a shell command or a list of them"):
        parse_cluster("setup: [1]\nnodes: [{host: a, gpus: 1}]\n")


def test_sync_short_and_long_forms_and_their_errors(tmp_path):
    (tmp_path / "proj").mkdir()
    head = "nodes: [{host: a, gpus: 1}]\nworkdir: ~/w\n"
    path = str(tmp_path / "c.yaml")
    short = parse_cluster(head + "sync: proj\n", path).sync
    assert (short.src, short.exclude, short.gitignore, short.line) == (str(tmp_path / "proj"), (), True, 3)
    long = parse_cluster(head + "sync: {src: proj, exclude: data/, gitignore: false}\n", path).sync
    assert (long.exclude, long.gitignore) == (("data/",), False)
    assert parse_cluster(head + "sync: false\n", path).sync is None
    for text, message in (
        ("sync: nowhere\n", f"c.yaml:3: sync: {tmp_path / 'nowhere'} is not a directory"),
        ("sync: {exclude: [x]}\n", "c.yaml:3: sync: missing `src:`"),
        ("sync: {src: proj, gitignore: 'yes'}\n", "c.yaml:3: sync.gitignore: must be true or false"),
        ("sync: {src: proj, exclude: [1]}\n", "c.yaml:3: sync.exclude: must be a gitignore-style pattern"),
        ("sync: {src: proj, excludes: [a]}\n", "c.yaml:3: sync.excludes: unknown key; did you mean `exclude`?"),
    ):
        with pytest.raises(ConfigError) as e:
            parse_cluster(head + text, path)
        assert message in str(e.value), str(e.value)


@pytest.mark.parametrize("name", ["cluster.example.yaml", "local.yaml", "local-gpus.yaml"])
def test_the_shipped_configs_are_valid(name):
    from pathlib import Path

    from orchestrator.config.clusterfile import load_cluster

    path = Path(__file__).resolve().parents[2] / "configs" / name
    assert load_cluster(str(path)).nodes


def test_slurm_nodes_are_reached_through_srun_unless_the_file_says_otherwise():
    from orchestrator.config.clusterfile import load_cluster
    from orchestrator.config.cluster import NodeSource

    source = NodeSource("--slurm", "", [{"host": "n1", "gpus": 1}, {"host": "n2", "gpus": 1}], transport="srun")
    assert {n.transport for n in load_cluster(None, source).nodes} == {"srun"}
    import tempfile
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write("transport: ssh\n")
        f.flush()
        assert {n.transport for n in load_cluster(f.name, source).nodes} == {"ssh"}
