"""The workdir copy's progress bar: on a terminal, for copies big enough to wait for."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

LARGE = 8_000_000  # bytes, all nodes together; smaller copies take about as long as drawing a bar


@contextmanager
def transfer_progress(console: Console, total: int, nodes: int) -> Iterator[Callable[[int], None]]:
    """Yields ``advance(bytes)``, safe to call from every node's thread; the bar is transient."""
    if not console.is_terminal or total < LARGE:
        yield lambda n: None
        return
    columns = (TextColumn("[bold]sync[/] {task.description}"), BarColumn(), DownloadColumn(),
               TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(f"to {nodes} node(s)", total=total)
        yield lambda n: bar.advance(task, n)
