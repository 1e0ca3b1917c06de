"""Issue 17: the network faults of real clusters, caught or worked around before launch."""

from __future__ import annotations

import re
import shutil

import pytest

from tests.harness.runner import ddp_check, ddp_up
from tests.integration.conftest import SCRIPT


@pytest.mark.long
def test_hostnames_that_resolve_off_the_route_no_longer_break_gloo(cluster, cluster_file):
    """Each node's hostname resolves to an address on an interface only it has (a management
    NIC): gloo left to itself binds there and the peers cannot connect. ddp-up names eth0, the
    interface of the route to the master, and the job runs."""
    nodes = cluster.nodes[:2]
    path = cluster_file([(0, 1), (1, 1)], env={"OMP_NUM_THREADS": 1, "JOB_PG_TIMEOUT": 10})
    with cluster.hostnames_off_route(nodes):
        code, out, _ = ddp_up("--no-preflight", str(path), SCRIPT, "run")  # the fault, as plain torchrun has it
        assert code == 1 and "READY" not in out, out
        code, out, _ = ddp_up(str(path), SCRIPT, "run")
        assert code == 0, out
        assert out.count("READY rank=") == 2
        assert "GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME set to the interface that reaches the master: eth0 on " \
               "every node" in out, out
        assert f"hostname off the route to the master on {nodes[0].addr} ({nodes[0].name} is " \
               f"{cluster.mgmt_addr(nodes[0])}, on mgmt0), {nodes[1].addr}" in out, out
        code, out = ddp_check(str(path), SCRIPT)
        assert code == 0 and re.search(rf"│ 1\s+│ {re.escape(nodes[1].addr)}\s+│ ✓ .*│ eth0 ", out), out


def test_an_interface_setting_with_no_route_to_the_master_is_refused_before_start(cluster, cluster_file):
    nodes = cluster.nodes[:2]
    with cluster.hostnames_off_route(nodes):
        path = cluster_file([(0, 1), (1, 1)], env={"OMP_NUM_THREADS": 1, "GLOO_SOCKET_IFNAME": "mgmt0",
                                                   "NCCL_SOCKET_IFNAME": "eth9"})
        code, out, _ = ddp_up(str(path), SCRIPT, "run")
    assert code == 3, out
    assert f"{nodes[1].addr}: GLOO_SOCKET_IFNAME=mgmt0: interface mgmt0 has no route to the master" in out, out
    assert "fix: unset GLOO_SOCKET_IFNAME (ddp-up then names the right one) or set `GLOO_SOCKET_IFNAME: eth0`" in out
    assert f"{nodes[0].addr}: NCCL_SOCKET_IFNAME=eth9: selects no interface of this node" in out, out
    assert "READY" not in out and "nothing was started" in out


@pytest.mark.long
@pytest.mark.skipif(shutil.which("tc") is None, reason="needs tc (iproute2) to shape a link")
def test_ddp_check_collective_names_the_node_with_the_slow_link_and_only_it(cluster, cluster_file):
    path = cluster_file([(0, 1), (1, 1), (2, 1), (3, 1)])
    slow = cluster.nodes[2]
    with cluster.slow_link(slow, "20mbit"):
        code, out = ddp_check("--collective", str(path), timeout=150)
    assert code == 3, out
    assert "all_reduce across 4 nodes (gloo)" in out, out
    named = re.findall(r"✗ (\S+): its link is far slower than the other nodes'", out)
    assert named == [slow.addr], out
    assert re.search(rf"│\s+2 │ {re.escape(slow.addr)}\s+│.*slow: 0\.\d\d× the median", out), out
    assert "skipped: the smaller size says too slow" in out  # 16 MB through 20 Mbit/s: not waited for
    assert "the probe forked from a warm interpreter on 4 of 4 nodes" in out, out  # each node imported torch once
    code, out = ddp_check("--collective", str(path), timeout=150)  # the link restored: nobody is named
    assert code == 0 and "far slower" not in out, out
