"""Which transport reaches a node: from its cluster-file settings to one Transport (transport.py).

Apart from the base so that the base never imports its subclasses (each imports the base).
"""

from __future__ import annotations

from ..config.cluster import NodeConfig
from .openssh import OpenSSHTransport, drop_shared
from .paramiko_ssh import SSHTransport
from .srun import SrunTransport
from .transport import LocalTransport, Transport


def transport_for(node: NodeConfig, shared: bool = True, bulk: bool = False, master: bool = True) -> Transport:
    """How to reach ``node``; ``shared``: over the run's SSH connection to it, where there is one;
    ``bulk``: for a connection that carries bulk bytes (see openssh.bulk_ciphers); ``master``:
    whether it may become the run's connection (sshmaster.SSHRun.options)."""
    if node.transport == "local":
        return LocalTransport(node)
    if node.transport == "srun":
        return SrunTransport(node)
    if node.ssh.client == "openssh":
        return OpenSSHTransport(node, shared, bulk, master)
    return SSHTransport(node)


def forget_connection(node: NodeConfig) -> None:
    """``node`` was lost: the run's shared connection to it is never used again (openssh.drop_shared);
    the other transports share none across calls."""
    if node.transport == "ssh" and node.ssh.client == "openssh":
        drop_shared(node)
