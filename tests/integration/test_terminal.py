"""The node's Screen against a real terminal: the same bytes, drawn by real tqdm as Lightning, the
Hugging Face Trainer and plain scripts draw them, shown by tmux and read by node/watch/screen.py, give
the same lines (a row a bar left blank is not sent: empty lines are compared out)."""

from __future__ import annotations

import io
import os
import shlex

import pytest

from orchestrator.node.watch.screen import Screen
from orchestrator.clean import safe_lines

tqdm = pytest.importorskip("tqdm").tqdm


def bar(out, **kw):
    return tqdm(file=out, mininterval=0, miniters=1, ncols=80, ascii=False, **kw)


def lightning(out):
    """TQDMProgressBar: the epoch bar at position 0, validation at position 1 with leave=False."""
    for epoch in range(2):
        main = bar(out, total=6, desc=f"Epoch {epoch}", position=0, leave=True)
        for step in range(6):
            main.update(1)
            if step == 2:
                val = bar(out, total=3, desc="Validation", position=1, leave=False)
                for _ in range(3):
                    val.update(1)
                val.close()
        main.close()
        print(f"Epoch {epoch} done, checkpoint saved", file=out)
    print("`Trainer.fit` stopped: `max_epochs=2` reached.", file=out)


def hf_trainer(out):
    """One bar for the run; log lines through tqdm.write (it clears the bar, prints, redraws)."""
    main = bar(out, total=8, desc="train")
    for step in range(8):
        main.update(1)
        if step % 3 == 2:
            tqdm.write(f"{{'loss': {1.0 / (step + 1):.4f}, 'epoch': {step / 8:.2f}}}", file=out)
    main.close()
    print("{'train_runtime': 1.5, 'train_loss': 0.31}", file=out)


def nested(out):
    outer = bar(out, total=3, desc="epochs")
    for _ in range(3):
        for _ in bar(out, iterable=range(4), desc="steps", position=1, leave=False):
            pass
        outer.update(1)
    outer.close()
    print("done", file=out)


def hand(out):
    for i in range(12):
        print(i, end="\r", file=out)
    print("finished after 12", file=out)
    cleared = bar(out, total=3, desc="warmup", leave=False)
    cleared.update(3)
    cleared.close()
    print("\x1b[32mgreen\x1b[0m and plain", file=out)


def rich_bars(out):
    """Rich's live progress, as Lightning's RichProgressBar draws it on a terminal (a rank's,
    under node/attempt/placement.TERMINAL_ENV): "\\r" and erase-line each refresh, colors, the cursor hidden."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    console = Console(file=out, force_terminal=True, force_interactive=True, width=100, color_system="256")
    with Progress(TextColumn("Epoch 0"), BarColumn(), MofNCompleteColumn(), console=console, auto_refresh=False) as bars:
        task = bars.add_task("train", total=5)
        for _ in range(5):
            bars.update(task, advance=1)
            bars.refresh()
    console.print("[bold]fit done[/bold]")


SAMPLES = {"lightning": lightning, "hf_trainer": hf_trainer, "nested": nested, "hand": hand, "rich": rich_bars}


def drawn(write) -> bytes:
    out = io.StringIO()
    write(out)
    return out.getvalue().encode()


def screen_lines(data: bytes, chunk: int) -> list[str]:
    """What the Screen sends of ``data`` read ``chunk`` bytes at a time, as lines. The reads cut
    escapes and characters anywhere, but not between tqdm's very first step down and its step back
    up (test_screen.py: that costs the outer bar's first state one line)."""
    now = [0.0]
    screen = Screen(clock=lambda: now[0])
    up = data.find(b"\x1b[A") + 3
    out = [screen.feed(data[:up])] if up > 2 else []
    for i in range(max(up, 0) if up > 2 else 0, len(data), chunk):
        out.append(screen.feed(data[i:i + chunk]))
        now[0] += 0.0005  # a read every half millisecond: a bar drawn in several reads stays one draw
        out.append(screen.settle())
    out.append(screen.end())
    text = safe_lines(b"".join(out).decode("utf-8", "replace"))  # as the console shows it: no escape
    return [line.rstrip() for line in text.splitlines() if line.strip()]


def terminal_lines(tmux, path) -> list[str]:
    command = f"cat {shlex.quote(str(path))}; tmux -L {tmux.socket} wait-for -S shown; sleep 60"
    tmux("new-session", "-d", "-x", "200", "-y", "100", "-s", "t", command)
    tmux("wait-for", "shown")  # bounded by the fixture's 30 s
    shown = tmux("capture-pane", "-p", "-t", "t")
    tmux("kill-session", "-t", "t")
    return [line.rstrip() for line in shown.splitlines() if line.strip()]


@pytest.mark.parametrize("sample", SAMPLES)
def test_the_screen_shows_what_a_terminal_shows(tmux, tmp_path, sample):
    data = drawn(SAMPLES[sample])
    path = tmp_path / f"{sample}.bin"
    path.write_bytes(data)
    expected = terminal_lines(tmux, path)
    assert len(expected) >= 2, expected
    for chunk in (len(data), 7, 1):  # one read, and reads that cut escapes and characters in two
        assert screen_lines(data, chunk) == expected, (sample, chunk)
