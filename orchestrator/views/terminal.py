"""The terminal ddp-up prints on: stdout behind a guard, so a closed pipe or a lost terminal turns
the console off instead of failing the job. Light on purpose: every command's first print
(ddp-fetch's, ddp-ls's table) comes through here, before or without the views."""

from __future__ import annotations

import os
import sys
from typing import Callable, TextIO

from rich.console import Console


class GuardedStream:
    """The console's stdout. A write to a closed pipe (``ddp-up ... | head``) or a terminal that
    went away turns the console off instead of raising into the job loop: the job goes on, its
    log files fill, and the exit status is still the job's. The stream is pointed at /dev/null,
    so Python's own flush at exit cannot fail either."""

    def __init__(self, stream: TextIO, warn: Callable[[str], None] | None = None):
        self.stream = stream
        self.warn = warn or _warn_on_stderr
        self.gone: str | None = None

    def write(self, text: str) -> int:
        if self.gone is None:
            try:
                self.stream.write(text)
            except OSError as e:
                self._lost(e)
        return len(text)

    def flush(self) -> None:
        if self.gone is None:
            try:
                self.stream.flush()
            except OSError as e:
                self._lost(e)

    def isatty(self) -> bool:
        return self.gone is None and self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()

    @property
    def encoding(self) -> str:
        return getattr(self.stream, "encoding", None) or "utf-8"

    def _lost(self, e: OSError) -> None:
        self.gone = e.strerror or type(e).__name__
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.stream.fileno())
            os.close(devnull)
        except (OSError, ValueError):
            pass
        self.warn(f"ddp-up: stdout is gone ({self.gone}); the job goes on, its output still reaches the run logs")


def _warn_on_stderr(text: str) -> None:
    try:
        print(text, file=sys.stderr, flush=True)
    except OSError:
        pass


def terminal_console(**kwargs) -> Console:
    """The Console ddp-up prints through: stdout behind a GuardedStream."""
    return Console(file=GuardedStream(sys.stdout), highlight=False, soft_wrap=True, **kwargs)
