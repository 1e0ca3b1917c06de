"""Errors that carry their data and render themselves; the CLI maps them to exit codes."""

from __future__ import annotations

from dataclasses import dataclass

# Exit statuses, documented in the README. Shell convention for signals: 128 + signum.
EXIT_OK = 0
EXIT_JOB_FAILED = 1
EXIT_USAGE = 2
EXIT_SETUP = 3
EXIT_INTERRUPTED = 130
EXIT_INTERNAL = 70  # a bug in ddp-up (EX_SOFTWARE); the job's nodes still stop on their own


class DdpUpError(Exception):
    """Base class: ``render()`` is the one message a user sees; ``exit_code`` the status."""

    exit_code = EXIT_JOB_FAILED

    def render(self) -> str:
        return str(self)


@dataclass
class ConfigError(DdpUpError):
    """A cluster file problem, located at file:line and key."""

    path: str
    line: int | None
    key: str
    message: str

    exit_code = EXIT_USAGE

    def __str__(self) -> str:
        where = f"{self.path}:{self.line}" if self.line else self.path
        return f"{where}: {self.key}: {self.message}" if self.key else f"{where}: {self.message}"


class UsageError(DdpUpError):
    """Bad command-line input."""

    exit_code = EXIT_USAGE


@dataclass
class NodeProblem:
    """Why one node could not take part, and what the user should do about it."""

    node: str
    what: str
    fix: str = ""

    def render(self) -> str:
        return f"{self.node}: {self.what}" + (f"\n    fix: {self.fix}" if self.fix else "")


@dataclass
class SetupError(DdpUpError):
    """One or more nodes failed to connect or preflight; nothing was started anywhere."""

    problems: list[NodeProblem]

    exit_code = EXIT_SETUP

    def __str__(self) -> str:
        head = f"{len(self.problems)} node(s) not ready; nothing was started:"
        return "\n".join([head, *("  " + p.render() for p in self.problems)])


class NoSuchJob(DdpUpError):
    """A job id that no node keeps (ddp-attach, ddp-logs)."""

    exit_code = EXIT_SETUP

    def __init__(self, job: str, nodes: list[str], cluster: str):
        where = ", ".join(nodes[:3]) + (f" and {len(nodes) - 3} more" if len(nodes) > 3 else "")
        super().__init__(f"no detached job {job} on {where}: ddp-ls {cluster} lists the jobs there")


class Interrupted(Exception):
    """A signal arrived before any job existed; raised at a point that reads the signal inbox
    (between start-up steps, or by a parallel wait after it closed its calls), never by a handler."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum
