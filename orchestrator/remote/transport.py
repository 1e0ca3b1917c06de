"""How the controller reaches a node: the Transport interface, the local one, and the command line
every transport runs on the node.

Every transport (local here; paramiko in paramiko_ssh.py, the OpenSSH client in openssh.py,
srun in srun.py; transports.py picks one) gives the same small surface: ``connect()``, then
``start(command)`` returning a ``RemoteProcess`` with byte-chunk reads of stdout/stderr,
``write`` to stdin, and an exit status; so sessions, tests and the localhost demo share one code
path.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import threading
from abc import ABC, abstractmethod
from typing import Mapping

from ..config.cluster import NodeConfig, quote_path
from ..errors import NodeProblem
from ..node.files.sync import widen_pipe
from ..node.local.procs import JOB_TMPDIR  # TMPDIR as setup left it, for the job: "set:VALUE", or empty when unset

# The most one read of the agent's stdout takes (what is there: less). A pipe holds 64 KiB; a
# read asking for more makes Python allocate that much first, above glibc's mmap threshold: a
# fresh mapping a read, and its page faults (1 GiB through a pipe, read 1 MiB at a time: 170,000
# faults and 0.28 s of system time; 64 KiB at a time: 7,000 and 0.10 s).
CHUNK = 1 << 16
# The longest a close waits for stdin to close. A write blocked on a peer that reads no more (an ssh
# client whose link went down) holds the stream's lock, and closing it would wait on that write for
# as long as TCP retries; past this the process is ended instead, which fails the write.
CLOSE_WAIT = 1.0


class ConnectFailed(Exception):
    """Carries the NodeProblem to show; raised by ``Transport.connect``."""

    def __init__(self, problem: NodeProblem):
        super().__init__(problem.what)
        self.problem = problem


class RemoteProcess(ABC):
    """The agent process on a node, as seen from the controller."""

    @abstractmethod
    def read_stdout(self) -> bytes:
        """Next chunk of stdout; b'' at end of stream. Blocks."""

    @abstractmethod
    def read_stderr(self) -> bytes:
        """Next chunk of stderr; b'' at end of stream. Blocks."""

    @abstractmethod
    def write(self, data: bytes) -> None:
        """Write to the process's stdin; raises OSError once the stream is gone."""

    @abstractmethod
    def exit_status(self, timeout: float) -> int | None:
        """Exit status once known (waits up to ``timeout``), else None."""

    @abstractmethod
    def close(self) -> None:
        """Close the streams; the agent sees EOF on stdin and stops its job."""

    def terminate(self) -> None:
        """End the process here now (a call cut short): a write blocked on its stdin fails."""
        self.close()


class Transport(ABC):
    def __init__(self, node: NodeConfig):
        self.node = node

    @abstractmethod
    def connect(self) -> None:
        """Open the connection; raise ConnectFailed with a user-facing reason and fix."""

    @abstractmethod
    def start(self, python: str, bootstrap_args: list[str], tags: Mapping[str, str],
              setup: tuple[str, ...] = (), workdir: str | None = None) -> RemoteProcess:
        """Run ``python -u ARGS`` (remote/protocol.bootstrap_args) on the node with ``tags`` in its environment,
        after the ``setup`` commands (in ``workdir``, in the same shell, so what they export and
        activate is the agent's and the job's environment)."""

    def close(self) -> None:
        """Drop the connection (idempotent)."""


# --- local ------------------------------------------------------------------------------------

class LocalProcess(RemoteProcess):
    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        if proc.stdout is not None:
            widen_pipe(proc.stdout.fileno())  # room for a megabyte: the agent writes on (files back, a flood of lines)

    def read_stdout(self) -> bytes:
        return _read_fd(self.proc.stdout)

    def read_stderr(self) -> bytes:
        return _read_fd(self.proc.stderr)

    def write(self, data: bytes) -> None:
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.flush()
        except ValueError:  # closed by close() on another thread: the same as a closed pipe
            raise BrokenPipeError("stdin closed") from None

    def exit_status(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> None:
        """Close stdin, within CLOSE_WAIT: never a wait on the peer (see CLOSE_WAIT)."""
        closer = threading.Thread(target=self._close_stdin, name="stdin-close", daemon=True)
        closer.start()
        closer.join(CLOSE_WAIT)
        if closer.is_alive():
            self.terminate()

    def _close_stdin(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass

    def terminate(self) -> None:
        """Its session: started as one (start_new_session), so what it started ends with it (a
        setup's command, ssh's ProxyCommand), and no one of them holds the pipe on. As
        Popen.send_signal does: only while it is not reaped, so the id is still its own."""
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except OSError:
            pass


def _read_fd(stream) -> bytes:
    try:
        return os.read(stream.fileno(), CHUNK)
    except (OSError, ValueError):
        return b""


class LocalTransport(Transport):
    """A node on this machine, behind the same interface as SSH (the demo, and tests)."""

    def connect(self) -> None:
        pass

    def start(self, python: str, bootstrap_args: list[str], tags: Mapping[str, str],
              setup: tuple[str, ...] = (), workdir: str | None = None) -> RemoteProcess:
        env = {**os.environ, **tags}
        argv = [os.path.expanduser(python), "-u", *bootstrap_args]
        if setup:
            argv = ["bash", "-c", setup_script(setup, workdir, shlex.join(["exec", *argv]))]
        try:
            proc = subprocess.Popen(argv, env=env,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True)  # Ctrl-C reaches ddp-up only
        except OSError as e:
            raise ConnectFailed(NodeProblem(self.node.label, f"cannot run {python}: {e.strerror}",
                                            "set `python:` to an interpreter that exists")) from None
        return LocalProcess(proc)


def remote_command(python: str, bootstrap_args: list[str], tags: Mapping[str, str],
                   setup: tuple[str, ...] = (), workdir: str | None = None) -> str:
    """The one line the node's login shell runs: the agent, with the tags in its environment,
    after the setup commands. Every value is shell-quoted."""
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in tags.items())
    command = f"exec env {env} {quote_path(python)} -u {' '.join(shlex.quote(a) for a in bootstrap_args)}"
    if setup:  # bash, whatever the login shell: setup lines are written for it (`source`)
        command = "exec bash -c " + shlex.quote(setup_script(setup, workdir, command))
    return command


SETUP_FAILED = 96  # the exit status of the agent's shell when a setup command failed
SETUP_MARK = "ddp-up: setup command"


BEFORE_SETUP = "DDP_UP_TMPDIR_BEFORE"  # (bash only) TMPDIR before setup: "set:VALUE", or empty when unset


def setup_script(setup: tuple[str, ...], workdir: str | None, then: str) -> str:
    """bash: run each setup command in ``workdir``, stop at the first failure with its number
    and status, else ``then`` (an exec). Setup commands get no stdin (the agent's source arrives
    there) and write to stderr (stdout carries the agent's frames)."""
    lines = [f"cd {quote_path(workdir or '~')} 2>/dev/null || true", f"{BEFORE_SETUP}=${{TMPDIR+set:$TMPDIR}}"]
    for i, command in enumerate(setup, start=1):
        # `:` first: a line that is only a comment (or that a comment ends) still makes a block
        lines.append(f"{{ :\n{command}\n}} </dev/null >&2 || {{ echo \"{SETUP_MARK} {i} failed with status $?\" >&2; "
                     f"exit {SETUP_FAILED}; }}")
    # The agent keeps its state under the TMPDIR from before setup, where ddp-ls, ddp-kill and
    # ddp-attach (which run no setup) look; the job gets setup's (node/attempt/checks.py's job_env).
    lines.append(f"export {JOB_TMPDIR}=${{TMPDIR+set:$TMPDIR}}")
    lines.append(f'case ${BEFORE_SETUP} in set:*) export TMPDIR="${{{BEFORE_SETUP}#set:}}";; *) unset TMPDIR;; esac')
    return "\n".join([*lines, then])
