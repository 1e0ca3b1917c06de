"""What of a job's text may reach a terminal: its own module, so that code that only reads a
job's words (flight.py) can clean them without importing the views."""

# A rank's output must not drive the terminal (clear the screen, move the cursor under the
# dashboard): C0 and C1 controls and DEL are dropped, tabs kept; bytes that were not UTF-8 (kept
# as surrogates for the log files) show as U+FFFD.
_CONTROL = {c: None for c in (*range(0, 9), *range(10, 32), *range(127, 160))}
_CONTROL.update({c: "\ufffd" for c in range(0xDC80, 0xDD00)})


def safe_text(text: str) -> str:
    return text if text.isprintable() else text.translate(_CONTROL)  # the test is C-fast; most lines pass


def safe_lines(text: str) -> str:
    """``text`` cleaned line by line: its own line breaks kept (an error that lists one node per
    line), everything else safe_text drops, dropped."""
    return "\n".join(safe_text(line) for line in text.split("\n"))
