import pytest

from orchestrator.config.clusterfile import parse_cluster
from orchestrator.node.protocol import wire
from orchestrator.node import needs
from orchestrator.node.userpython.standin import LOADER as WARM_STUB
from orchestrator.plan.launch import LEGACY_SHIM, display_quote, make_plan, new_job_id, quote_path, warm_refused

CLUSTER = """\
nodes:
  - {host: 10.0.0.1, gpus: 1}
  - {host: gpu-b, gpus: 3, addr: 10.0.0.2, env: {NCCL_SOCKET_IFNAME: eth1}}
python: /opt/py/bin/python3
workdir: ~/proj
master: {port: 29400}
orphan_timeout: 20
"""


def plan(args=("--lr", "0.1")):
    cfg = parse_cluster(CLUSTER, "/etc/c.yaml")
    return make_plan(cfg, "train.py", list(args), "20261122-000000-abcdef", "/here")


def test_global_ranks_are_contiguous_in_node_order():
    p = plan()
    assert [(n.index, list(n.ranks)) for n in p.nodes] == [(0, [0]), (1, [1, 2, 3])]
    assert p.world_size == 4 and p.master.index == 0


def test_launcher_argv_golden():
    p = plan()
    torchrun = ["/opt/py/bin/python3", "-u", "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=3",
                "--node-rank=1", "--master-addr=10.0.0.1", "--master-port=29400", "--redirects=3"]
    p = make_plan(parse_cluster(CLUSTER + "warm: true\n", "/etc/c.yaml"), "train.py", ["--lr", "0.1"], "j", "/here")
    # warm start: torchrun's workers are stand-ins that ask the node's warm interpreter
    assert p.launcher_argv(p.nodes[1], 29400) == [
        *torchrun, "--no-python", "/opt/py/bin/python3", "-S", "-c" + WARM_STUB, "train.py", "--lr", "0.1"]
    cold = make_plan(parse_cluster(CLUSTER + "warm: false\n", "/etc/c.yaml"), "train.py", ["--lr", "0.1"], "j", "/here")
    assert cold.launcher_argv(cold.nodes[1], 29400) == [*torchrun, "train.py", "--lr", "0.1"]
    assert p.launcher_argv(p.nodes[1], 29400, warm=False) == cold.launcher_argv(cold.nodes[1], 29400)  # by hand


def test_agent_spec_golden():
    p = plan()
    spec = p.agent_spec(p.nodes[0])
    assert spec == wire.RunSpec(
        job="20261122-000000-abcdef", node=0, cluster=p.cluster_id, run=p.run_token, workdir="~/proj",
        script="train.py", env={},
        pick_port=False, check_port=29400, orphan_timeout=20.0, stop_grace=10.0, heartbeat=5.0, stack_dumps=False,
        nproc=1, flight_recorder=True, warm=True)  # warm start: torchrun's default
    assert p.agent_spec(p.nodes[1]).check_port is None  # only the master checks its port
    assert p.agent_spec(p.nodes[1]).env["NCCL_SOCKET_IFNAME"] == "eth1"


@pytest.mark.parametrize("keys, warm", [("", True), ("launcher: none\n", False),
                                        ("launcher: none\npreload: [numpy]\n", True), ("warm: false\n", False),
                                        ("launcher: none\nwarm: true\n", True)])
def test_warm_start_is_on_by_default_where_the_nodes_surely_have_torch_or_preload_asks(keys, warm):
    p = make_plan(parse_cluster(CLUSTER + keys, "/etc/c.yaml"), "train.py", [], "j", "/here")
    assert p.agent_spec(p.nodes[0]).warm is warm


def test_auto_port_is_picked_by_the_master_only():
    cfg = parse_cluster(CLUSTER.replace("master: {port: 29400}", "master: {addr: 10.0.0.2}"), "/etc/c.yaml")
    p = make_plan(cfg, "t.py", [], "j", "/")
    assert p.master.index == 1  # master.addr names node 1's addr
    assert [p.agent_spec(n).pick_port for n in p.nodes] == [False, True]


def test_shell_line_quotes_every_value():
    p = plan(["$(rm -rf ~)", "a b", "it's"])
    line = p.shell_line(p.nodes[1], 29400)
    assert line == (
        'cd "$HOME"/proj && env DDP_UP_JOB=20261122-000000-abcdef DDP_UP_NODE=1 '
        f"DDP_UP_CLUSTER={p.cluster_id} DDP_UP_RUN={p.run_token} DDP_UP_ATTEMPT=0 NCCL_SOCKET_IFNAME=eth1 "
        "/opt/py/bin/python3 -u -m torch.distributed.run "
        "--nnodes=2 --nproc-per-node=3 --node-rank=1 --master-addr=10.0.0.1 --master-port=29400 --redirects=3 train.py "
        "'$(rm -rf ~)' 'a b' 'it'\"'\"'s'")


def test_local_nodes_default_to_the_current_directory():
    cfg = parse_cluster("transport: local\nnodes: [{host: a, gpus: 1}]\n")
    assert make_plan(cfg, "t.py", [], "j", "/work/x").nodes[0].workdir == "/work/x"


def test_quoting_helpers():
    assert quote_path("~") == '"$HOME"'
    assert quote_path("~/a b") == "\"$HOME\"/'a b'"
    assert quote_path("/x;y") == "'/x;y'"
    assert display_quote("\x1d'") == "$'\\x1d\\x27'"


def test_job_ids_sort_by_time():
    assert new_job_id(0, "aaaaaa") < new_job_id(86400 * 365, "000000")


def test_legacy_launcher_passes_local_rank_the_old_way():
    cfg = parse_cluster(CLUSTER + "launcher: legacy\n", "/etc/c.yaml")
    p = make_plan(cfg, "train.py", ["--lr", "0.1"], "20261122-000000-abcdef", "/")
    argv = p.launcher_argv(p.nodes[1], 29400)
    assert argv[argv.index("--redirects=3") + 1:] == [
        "--no-python", "/opt/py/bin/python3", "-u", "-c", LEGACY_SHIM, "train.py", "--lr", "0.1"]


def test_launcher_none_runs_ddp_ups_own_launcher_with_the_ranks_it_planned():
    cfg = parse_cluster(CLUSTER + "launcher: none\n", "/etc/c.yaml")
    p = make_plan(cfg, "train.py", ["--lr", "0.1"], "20261122-000000-abcdef", "/")
    assert p.launcher_argv(p.nodes[1], 29400) == [
        "ddp-up-launch", "--nproc-per-node=3", "--node-rank=1", "--first-rank=1",
        "--world-size=4", "--master-addr=10.0.0.1", "--master-port=29400", "train.py", "--lr", "0.1"]
    assert not p.agent_spec(p.nodes[1]).needs_torch and plan().agent_spec(plan().nodes[0]).needs_torch


def test_stop_signal_is_checked_and_torchrun_is_told_to_pass_on_one_it_does_not_handle():
    """Issue 27, item 2: `stop_signal:` for scripts that save on SIGUSR1/SIGUSR2/SIGINT."""
    import pytest

    from orchestrator.errors import ConfigError
    nodes = "nodes: [{host: a, gpus: 2}]\n"
    for given, name in (("usr1", "SIGUSR1"), ("SIGINT", "SIGINT"), ("TERM", "SIGTERM")):
        plan = make_plan(parse_cluster(f"stop_signal: {given}\n" + nodes), "t.py", [], "J", "/")
        assert plan.stop_signal == name and plan.agent_spec(plan.nodes[0]).stop_signal == name
    usr1 = make_plan(parse_cluster("stop_signal: SIGUSR1\n" + nodes), "t.py", [], "J", "/")
    assert "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" in usr1.launcher_argv(usr1.nodes[0], 1)
    term = make_plan(parse_cluster(nodes), "t.py", [], "J", "/")
    assert not any(a.startswith("--signals-to-handle") for a in term.launcher_argv(term.nodes[0], 1))
    with pytest.raises(ConfigError, match="stop_signal: must be one of SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, "
                                          "SIGUSR2 .*got 'SIGKILL'"):
        parse_cluster("stop_signal: SIGKILL\n" + nodes)


def test_launcher_accelerate_passes_ddp_ups_ranks_and_the_node_adds_its_own_options(tmp_path, monkeypatch):
    from orchestrator.errors import UsageError
    from orchestrator.node.attempt import placement

    config = parse_cluster("launcher: accelerate\nnodes: [{host: a, gpus: 2}, {host: b, gpus: 2}]\n", "c.yaml")
    plan = make_plan(config, "train.py", ["--lr", "1"], "J", "/w")
    argv = plan.launcher_argv(plan.nodes[1], 29500)
    assert argv[3:] == ["accelerate.commands.launch", "--num_machines=2", "--machine_rank=1", "--num_processes=4",
                        "--main_process_ip=a", "--main_process_port=29500", "--same_network",
                        placement.ACCELERATE_NODE_OPTIONS, "train.py", "--lr", "1"]
    monkeypatch.setattr(placement.facts, "has_nvidia_gpus", lambda: False)
    env = {"HF_HOME": str(tmp_path)}
    mine = placement.accelerate_options(argv, env, "/state/logs", "SIGUSR1")
    assert mine[10:14] == ["--log_dir=/state/logs", "--multi_gpu", "--mixed_precision=no", "--dynamo_backend=no"]
    assert mine[14:] == ["train.py", "--lr", "1"]  # accelerate's "values were not passed" notice: none left to say
    assert "--mixed_precision=bf16" in placement.accelerate_options(argv, {**env, "ACCELERATE_MIXED_PRECISION": "bf16"},
                                                                "/state/logs", "SIGTERM")  # the job's own value
    shown = plan.shell_line(plan.nodes[1], 29500)  # --dry-run's line runs by hand, as the other launchers' do
    assert placement.ACCELERATE_NODE_OPTIONS not in shown and "--same_network --multi_gpu --mixed_precision=no" in shown
    assert env["ACCELERATE_USE_CPU"] == "true" and env["PET_REDIRECTS"] == "3"
    assert env["PET_SIGNALS_TO_HANDLE"].endswith(",SIGUSR1")
    (tmp_path / "accelerate").mkdir()
    (tmp_path / "accelerate" / "default_config.yaml").write_text("distributed_type: FSDP\n")  # the user's config rules
    assert "--multi_gpu" not in placement.accelerate_options(argv, env, "/state/logs", "SIGTERM")
    uneven = parse_cluster("launcher: accelerate\nnodes: [{host: a, gpus: 2}, {host: b, gpus: 1}]\n", "c.yaml")
    with pytest.raises(UsageError, match="launcher: accelerate starts the same number of processes on every node"):
        make_plan(uneven, "train.py", [], "J", "/w")


@pytest.mark.parametrize("launcher, node, warm", [("torchrun", 0, True), ("none", 0, True), ("torchrun", 1, True),
                                                   ("none", 1, True), ("legacy", 0, False), ("legacy", 1, False)])
def test_warm_start_is_decided_once_here_per_node(launcher, node, warm):
    """torchrun and ddp-up's own launcher, on the host or in a container (node 1 has one), a
    script: the node's agent makes a warm interpreter only where its RunSpec says so, torchrun runs
    stand-ins, and a container runs the launcher that starts the interpreter in the image."""
    text = CLUSTER.replace("env: {NCCL_SOCKET_IFNAME: eth1}}", "container: {image: img}}") + \
        f"warm: true\nlauncher: {launcher}\n"
    p = make_plan(parse_cluster(text, "/etc/c.yaml"), "train.py", [], "20261122-000000-abcdef", "/here")
    assert p.agent_spec(p.nodes[node]).warm is warm
    argv = p.launcher_argv(p.nodes[node], 29400)
    assert ("--no-python" in argv and "-S" in argv) is (warm and launcher == "torchrun")
    code = p.agent_spec(p.nodes[node]).box_code
    assert (sorted(code) if code else None) == (None if node == 0 or launcher == "legacy" else
                                                 sorted(needs("launchers.boxwarm")))


@pytest.mark.parametrize("keys, said", [
    ("warm: true\nlauncher: legacy\n", "warm: true does not apply under `launcher: legacy`, which starts the ranks "
                                        "itself: the ranks start cold there (see the warm start guide)"),
    ("warm: true\nlauncher: none\n", None),  # ddp-up's own launcher forks them in a container too
    ("warm: true\n", None),  # as torchrun's ranks are
    ("", None),  # the default asked for nothing: nothing to tell
    ("warm: false\n", None)])
def test_warm_true_where_it_cannot_apply_is_said_once(keys, said):
    config = parse_cluster(CLUSTER.replace("env: {NCCL_SOCKET_IFNAME: eth1}}", "container: {image: img}}") + keys,
                           "/etc/c.yaml")
    assert warm_refused(config, make_plan(config, "train.py", [], "j", "/here")) == said
