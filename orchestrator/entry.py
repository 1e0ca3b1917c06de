"""Console entry points. Signals are recorded before anything else is imported, so a Ctrl-C
during start-up is an event like any other: no traceback, one message, exit 128+N."""

from __future__ import annotations

import sys

from .signals import INBOX


def _run(name: str) -> None:
    INBOX.install()
    from . import cli

    sys.exit(getattr(cli, name)())


def up() -> None:
    _run("main_up")


def kill() -> None:
    _run("main_kill")


def check() -> None:
    _run("main_check")


def attach() -> None:
    _run_detached("main_attach")


def logs() -> None:
    _run_detached("main_logs")


def ls() -> None:
    _run_detached("main_ls")


def _run_detached(name: str) -> None:
    INBOX.install()
    from . import detached

    sys.exit(getattr(detached, name)())
