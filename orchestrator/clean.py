"""What of a job's text may reach a terminal: a leaf module, so that every stage that shows a
rank's or a node's words (the diagnosis, the views, the commands) cleans them the same way."""

from __future__ import annotations

import re

from rich.style import Style
from rich.text import Text

# A rank's output must not drive the terminal (clear the screen, move the cursor under the
# dashboard): C0 and C1 controls and DEL are dropped, tabs kept; bytes that were not UTF-8 (kept
# as surrogates for the log files) show as U+FFFD.
_CONTROL = {c: None for c in (*range(0, 9), *range(10, 32), *range(127, 160))}
_CONTROL.update({c: "\ufffd" for c in range(0xDC80, 0xDD00)})
# Unicode's direction controls (embeddings, overrides, isolates, marks) reverse the text around them
# on a screen or a page ("Trojan Source"): each shows as U+FFFD, so that a reader sees one was there.
BIDI = {c: "\ufffd" for c in (0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A))}
_CONTROL.update(BIDI)


# Whole escape sequences (colors, cursor moves, a title: CSI and OSC, each bounded) go before the
# controls do: dropping only their ESC left "[32m" in the text of every colored line.
_ESCAPES = re.compile(r"\x1b\[[0-?]{0,32}[ -/]{0,4}[@-~]|\x1b\][^\x07\x1b]{0,512}(?:\x07|\x1b\\)|\x9b[0-?]{0,32}[ -/]{0,4}[@-~]")


def safe_text(text: str) -> str:
    if text.isprintable():  # the test is C-fast; most lines pass
        return text
    return _ESCAPES.sub("", text).translate(_CONTROL)


def safe_lines(text: str) -> str:
    """``text`` cleaned line by line: its own line breaks kept (an error that lists one node per
    line), everything else safe_text drops, dropped."""
    return "\n".join(safe_text(line) for line in text.split("\n"))


def outside(text: object, style: str | Style = "") -> Text:
    """Text that did not come from ddp-up itself (a host, a tag, a record's field, a script's name,
    a node's answer), for a table cell or a print: shown as it is, never read as rich markup
    (``[/x]`` is text, not a crash), with no terminal control in it."""
    return Text(safe_text(str(text)), style=style)
