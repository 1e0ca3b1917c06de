"""The node's network and GPU facts: parsing recorded /proc files and nvidia-smi output, and the
decisions made from them (which interface, which setting is refused, which GPU is busy)."""

from __future__ import annotations

import pytest

from orchestrator.diagnose import preflight
from orchestrator.node.probes import facts as nodefacts
from orchestrator.node.protocol import wire
from orchestrator.config.clusterfile import parse_cluster
from orchestrator.diagnose.outcome import NodeStatus, gpu_summary
from orchestrator.plan.launch import make_plan

# /proc/net/route of a node with a default route on eth0 (10.1.0.0/16), an InfiniBand subnet on
# ib0 and docker's bridge: hex in the host's (little-endian) byte order, as the kernel writes it.
ROUTES = """Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT
eth0\t00000000\t0100010A\t0003\t0\t0\t100\t00000000\t0\t0\t0
eth0\t0000010A\t00000000\t0001\t0\t0\t100\t0000FFFF\t0\t0\t0
ib0\t0000A8C0\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0
docker0\t000011AC\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0
"""
ADDRESSES = {"lo": ["127.0.0.1"], "eth0": ["10.1.2.3"], "ib0": ["192.168.2.3"], "docker0": ["172.17.0.1"]}
NAMES = ["lo", "eth0", "ib0", "docker0"]


def test_routes_are_read_most_specific_first():
    routes = nodefacts.parse_routes(ROUTES)
    assert nodefacts.routed_interfaces("192.168.7.1", routes) == ["ib0", "eth0"]  # its subnet, then the default
    assert nodefacts.routed_interfaces("10.1.9.9", routes) == ["eth0"]
    assert nodefacts.routed_interfaces("8.8.8.8", routes) == ["eth0"]
    assert nodefacts.routed_interfaces("not an address", routes) == []


def test_the_interface_that_reaches_the_master_is_the_one_holding_it_on_its_own_node():
    routes = nodefacts.parse_routes(ROUTES)
    assert nodefacts.interfaces_reaching("192.168.2.3", ADDRESSES, routes) == ["ib0"]  # the master itself
    assert nodefacts.interfaces_reaching("10.1.0.7", ADDRESSES, routes) == ["eth0"]


def test_ipv6_addresses_are_read_per_interface():
    text = ("00000000000000000000000000000001 01 80 10 80       lo\n"
            "fd000000000000000000000000000002 04 40 00 80     eth0\n")
    assert nodefacts.parse_if_inet6(text) == [("lo", "::1"), ("eth0", "fd00::2")]


@pytest.mark.parametrize("var, value, chosen", [
    ("GLOO_SOCKET_IFNAME", "eth0", ["eth0"]),
    ("GLOO_SOCKET_IFNAME", "eth0,ib0", ["eth0", "ib0"]),
    ("GLOO_SOCKET_IFNAME", "eth", []),  # gloo takes exact names
    ("NCCL_SOCKET_IFNAME", "eth", ["eth0"]),  # NCCL: prefixes
    ("NCCL_SOCKET_IFNAME", "=eth", []),  # '=': exact
    ("NCCL_SOCKET_IFNAME", "^docker,lo", ["eth0", "ib0"]),  # '^': all but these
    ("NCCL_SOCKET_IFNAME", "ib,eth", ["eth0", "ib0"]),  # in the node's order
])
def test_ifname_settings_select_interfaces_as_gloo_and_nccl_read_them(var, value, chosen):
    assert nodefacts.selected_interfaces(var, value, NAMES) == chosen


def test_an_explicit_interface_without_a_route_to_the_master_is_a_problem_naming_it():
    reaching = ["eth0"]
    check = nodefacts.check_ifnames
    assert check({"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "^docker,lo"}, NAMES, reaching) == (
        {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "^docker,lo"}, [])
    assert check({"GLOO_SOCKET_IFNAME": "docker0"}, NAMES, reaching)[1] == [
        ["GLOO_SOCKET_IFNAME", "docker0", "interface docker0 has no route to the master"]]
    assert check({"GLOO_SOCKET_IFNAME": "eth1"}, NAMES, reaching)[1] == [
        ["GLOO_SOCKET_IFNAME", "eth1", "names interface eth1, which this node does not have"]]
    # issue 26: gloo reads the names as written: a stray space (set by `setup:`) is not "eth0"
    assert check({"GLOO_SOCKET_IFNAME": "eth0 "}, NAMES, reaching)[1] == [
        ["GLOO_SOCKET_IFNAME", "eth0 ", "names interface 'eth0 ', which this node does not have"]]
    assert check({"NCCL_SOCKET_IFNAME": "ib"}, NAMES, reaching)[1] == [
        ["NCCL_SOCKET_IFNAME", "ib", "selects ib0, with no route to the master"]]
    assert check({"NCCL_SOCKET_IFNAME": "=mlx5"}, NAMES, reaching)[1] == [
        ["NCCL_SOCKET_IFNAME", "=mlx5", "selects no interface of this node"]]
    assert check({"GLOO_SOCKET_IFNAME": ""}, NAMES, reaching) == ({}, [])  # empty is unset


@pytest.mark.parametrize("master", ["127.0.0.1", "localhost"])
def test_the_real_node_answers_for_its_loopback_master(master):
    facts = nodefacts.network_facts(master, {"GLOO_SOCKET_IFNAME": "lo"})
    assert facts["iface"] == "lo" and facts["source"] in ("127.0.0.1", "::1")
    assert facts["explicit"] == {"GLOO_SOCKET_IFNAME": "lo"} and facts["bad"] == []


# nvidia-smi --query-gpu=index,uuid,utilization.gpu,memory.used,memory.total --format=csv,noheader,nounits
GPUS = """0, GPU-5a7c1e2f-0000-1111-2222-333344445555, 0, 30211, 81559
1, GPU-9b8d2f30-0000-1111-2222-333344445555, 87, 61234, 81559
2, GPU-c3d4e5f6-0000-1111-2222-333344445555, [N/A], 4, 81559
"""
# nvidia-smi --query-compute-apps=gpu_uuid,pid,used_memory,process_name --format=csv,noheader,nounits
APPS = """GPU-5a7c1e2f-0000-1111-2222-333344445555, 41233, 30208, /usr/bin/python3
GPU-9b8d2f30-0000-1111-2222-333344445555, 41977, [N/A], python
"""


def test_nvidia_smi_output_is_parsed_with_unknown_values_kept_unknown():
    gpus = nodefacts.parse_gpus(GPUS)
    assert [g["index"] for g in gpus] == [0, 1, 2] and gpus[2]["util"] is None and gpus[1]["used"] == 61234
    apps = nodefacts.parse_apps(APPS)
    assert apps[0] == {"uuid": "GPU-5a7c1e2f-0000-1111-2222-333344445555", "pid": 41233, "mib": 30208,
                       "name": "/usr/bin/python3"}
    assert apps[1]["mib"] is None
    assert nodefacts.parse_gpus("") == [] and nodefacts.parse_apps(None) == []
    assert nodefacts.parse_gpus("No devices were found\n") == []


@pytest.mark.parametrize("visible, nproc, used", [
    (None, 2, [0, 1]), (None, 1, [0]), (None, None, [0, 1, 2]),
    ("2,1", 2, [2, 1]), ("2,-1,0", 2, [2]),  # CUDA ignores everything from -1 on
    ("GPU-c3d4", 1, [2]),  # a UUID prefix, as CUDA accepts
])
def test_the_gpus_a_job_uses_are_the_first_it_sees(visible, nproc, used):
    assert nodefacts.job_gpu_indices(visible, nproc, nodefacts.parse_gpus(GPUS)) == used


def test_other_processes_on_the_jobs_gpus_are_busy_and_those_elsewhere_are_not():
    gpus, apps = nodefacts.parse_gpus(GPUS), nodefacts.parse_apps(APPS)
    owners = {41233: ("alice", "python3 old_run.py --epochs 90"), 41977: ("?", "")}
    busy = nodefacts.busy_gpus(gpus, apps, [0, 1], owners.__getitem__)
    assert busy == [{"gpu": 0, "pid": 41233, "user": "alice", "cmd": "python3 old_run.py --epochs 90", "mib": 30208},
                    {"gpu": 1, "pid": 41977, "user": "?", "cmd": "python", "mib": None}]
    assert nodefacts.busy_gpus(gpus, apps, [2], owners.__getitem__) == []


def test_a_missing_or_hanging_nvidia_smi_reads_as_no_answer(monkeypatch):
    from orchestrator.node.probes import smi

    monkeypatch.setattr(smi, "HANG", smi.HangMemory())  # the hang below is this test's

    def missing(*a, **k):
        raise FileNotFoundError("nvidia-smi")

    def hangs(argv, timeout):
        return None, b"", b""  # killed at its timeout
    assert smi.nvidia_smi(nodefacts.GPUS_QUERY, run=missing) is None
    assert smi.nvidia_smi(nodefacts.GPUS_QUERY, run=hangs) is None


# --- the controller's side: preflight decisions ---------------------------------------------------

def status(label: str, index: int = 0, **probed) -> NodeStatus:
    hosts = ", ".join(f"{{host: {label if i == index else f'other{i}'}, gpus: 1}}" for i in range(index + 1))
    s = NodeStatus(make_plan(parse_cluster(f"nodes: [{hosts}]\n"), "t.py", [], "J", "/").nodes[index])
    s.reach = wire.Probed(ok=True, **probed) if probed else None
    return s


def test_each_node_is_told_the_interface_of_its_route_unless_the_user_named_one():
    a = status("a", iface="eth0", explicit={})
    b = status("b", 1, iface="ib0", explicit={"NCCL_SOCKET_IFNAME": "ib"})
    assert preflight.interface_env(a) == {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"}
    assert preflight.interface_env(b) == {"GLOO_SOCKET_IFNAME": "ib0"}
    assert preflight.interface_env(status("c", iface=None)) == {}  # not found: left to gloo/NCCL
    assert preflight.interface_notices([a, b]) == [
        "GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME set to the interface that reaches the master: a eth0, b ib0"]
    same = [status(f"n{i}", i, iface="eth0", explicit={}) for i in range(5)]
    assert preflight.interface_notices(same) == [
        "GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME set to the interface that reaches the master: eth0 on every node"]


def test_hostnames_that_resolve_off_the_masters_route_are_named_in_one_line():
    s = [status(f"gpu{i}", i, iface="eth0", explicit={}, hostname=f"gpu{i}", resolves="127.0.1.1", resolves_iface="lo")
         for i in range(5)]
    s[1] = status("gpu1", 1, iface="eth0", explicit={}, hostname="gpu1", resolves="10.1.0.2", resolves_iface="eth0")
    assert preflight.interface_notices(s)[1] == (
        "hostname off the route to the master on gpu0 (gpu0 is 127.0.1.1, on lo), gpu2 (gpu2 is 127.0.1.1, on lo), "
        "gpu3 (gpu3 is 127.0.1.1, on lo) and 1 more: gloo left to itself would use that address, which the other "
        "nodes may not reach")


def test_an_explicit_interface_that_cannot_reach_the_master_is_refused_with_the_one_that_can():
    s = status("gpu7", iface="eth0", explicit={"GLOO_SOCKET_IFNAME": "docker0"},
               bad=[["GLOO_SOCKET_IFNAME", "docker0", "interface docker0 has no route to the master"]])
    [problem] = preflight.interface_problems([s])
    assert problem.render() == (
        "gpu7: GLOO_SOCKET_IFNAME=docker0: interface docker0 has no route to the master\n"
        "    fix: unset GLOO_SOCKET_IFNAME (ddp-up then names the right one) or set "
        "`GLOO_SOCKET_IFNAME: eth0` (the interface that reaches the master)")


def test_busy_gpus_stop_the_launch_unless_allowed():
    s = status("gpu7")
    s.info = {"busy_gpus": [{"gpu": 0, "pid": 41233, "user": "alice", "cmd": "python3 old_run.py", "mib": 30208}]}
    problems, notices = preflight.busy_gpus([s, status("gpu8", 1)], allowed=False)
    assert [p.render() for p in problems] == [
        "gpu7: 1 other process(es) hold memory on the job's GPUs: GPU 0: pid 41233 (alice, python3 old_run.py) "
        "holds 30,208 MiB\n    fix: stop them (a leftover run: ddp-kill CLUSTER.yaml), choose other GPUs with "
        "CUDA_VISIBLE_DEVICES in `env:`, or pass --allow-busy-gpus to share them"]
    assert notices == []
    problems, notices = preflight.busy_gpus([s], allowed=True)
    assert problems == [] and notices[0].endswith("holds 30,208 MiB (--allow-busy-gpus)")


def test_the_dashboard_sums_up_a_nodes_gpus():
    assert gpu_summary([[0, 80, 40960, 81920], [1, 90, 20480, 81920]]) == "85% 60/160G"
    assert gpu_summary([[0, None, 1024, 81920]]) == "- 1/80G"
    assert gpu_summary(None) == ""
