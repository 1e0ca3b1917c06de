"""Slurm as the engine (`transport: srun`, the default with --slurm): inside an allocation, each
node's agent is a job step, its stdin and stdout carrying the protocol exactly as ssh's do.

Slurm's own step launch (a tree over its slurmd daemons, no sshd needed on the nodes) and its
process tracking are the transport and the backstop: a step ends when its srun ends (ddp-up gone)
or when the allocation does (scancel, time limit), and the agent, seeing its input end, stops its
job first where it can. ``--overlap`` lets the steps share the allocation's CPUs with each other
and with the job's own steps.
"""

from __future__ import annotations

import shutil
import subprocess
from typing import Mapping

from ..errors import NodeProblem
from .transport import ConnectFailed, LocalProcess, RemoteProcess, Transport, remote_command


def srun_argv(host: str, command: str) -> list[str]:
    """One task on ``host``, in the current allocation, running ``command`` in bash."""
    return [shutil.which("srun") or "srun", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={host}",
            "--unbuffered",  # frames pass as they are written, not a line at a time
            "--quiet", "--chdir=/",  # the agent goes to the workdir itself; this path exists everywhere
            "--job-name=ddp-up", "bash", "-c", command]


class SrunTransport(Transport):
    def connect(self) -> None:
        pass  # Slurm is already there: the allocation

    def start(self, python: str, bootstrap_args: list[str], tags: Mapping[str, str],
              setup: tuple[str, ...] = (), workdir: str | None = None) -> RemoteProcess:
        command = remote_command(python, bootstrap_args, tags, setup, workdir)
        try:
            proc = subprocess.Popen(srun_argv(self.node.host, command), stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True)  # Ctrl-C reaches ddp-up only
        except OSError as e:
            raise ConnectFailed(NodeProblem(self.node.label, f"cannot run srun: {e.strerror}",
                                            "run ddp-up inside a Slurm allocation (salloc, sbatch), or set "
                                            "`transport: ssh`")) from None
        return LocalProcess(proc)
