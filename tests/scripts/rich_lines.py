"""Under Rich's live display with its streams redirected (as Lightning's bar, live in a rank): a line
of 120 characters printed, and a warning. Run with COLUMNS narrower than the line."""

import warnings

import rich
from rich.live import Live
from rich.text import Text

with Live(Text("bar"), console=rich.get_console(), auto_refresh=False, redirect_stdout=True, redirect_stderr=True):
    print("L" * 120)
    warnings.warn("a warning of the rank's")
