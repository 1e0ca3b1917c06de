"""The OpenSSH client transport's pure parts: the ssh command line, and ssh's words -> a problem."""

from __future__ import annotations

import pytest

from orchestrator.config import parse_cluster
from orchestrator.openssh import ssh_args, ssh_failure


def node(ssh: str = ""):
    return parse_cluster(f"ssh: {{client: openssh{ssh}}}\nnodes: [{{host: gpu-a, gpus: 1}}]\n", "/etc/c.yaml").nodes[0]


def test_only_what_the_cluster_file_sets_is_added_to_the_users_ssh():
    assert ssh_args(node())[1:] == ["-T", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]
    args = ssh_args(node(", user: me, port: 2222, identity_file: k, known_hosts: kh, config_file: /dev/null"))
    assert args[1:] == ["-F", "/dev/null", "-T", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-l", "me",
                        "-p", "2222", "-i", "/etc/k", "-o", "UserKnownHostsFile=/etc/kh"]


@pytest.mark.parametrize("stderr, what, fix", [
    (["No ED25519 host key is known for gpu-a and you have requested strict checking.",
      "Host key verification failed."], "unknown host key for gpu-a; refusing to connect",
     "ssh-keyscan gpu-a >> ~/.ssh/known_hosts"),
    (["@@@@@@@@", "@    WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED!     @", "Host key verification failed."],
     "host key for gpu-a CHANGED", "ssh-keygen -R gpu-a"),
    (["root@gpu-a: Permission denied (publickey)."], "SSH authentication failed for gpu-a", "authorized_keys"),
    (["ssh: Could not resolve hostname gpu-a: Name or service not known"], "cannot resolve host name 'gpu-a'",
     "DNS"),
    (["ssh: connect to host 10.0.0.1 port 22: Connection refused"], "connection refused by gpu-a", "start sshd"),
    (["ssh: connect to host 10.0.0.1 port 22: Connection timed out"], "no answer from gpu-a", "connect_timeout"),
    (["kex_exchange_identification: Connection closed by remote host"], "dropped the connection during the handshake",
     "max_parallel"),
    (["something new"], "ssh to gpu-a failed: something new", "ssh gpu-a true"),
])
def test_ssh_failures_become_one_problem_and_its_fix(stderr, what, fix):
    problem = ssh_failure(node(), stderr)
    assert problem.node == "gpu-a" and what in problem.what and fix in problem.fix
