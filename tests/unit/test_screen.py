"""Issue 29: a worker's stream read as a terminal shows it (node/watch/screen.py): progress bars drawn
with \\r and tqdm's cursor-up rows are live rows, every plain line still comes out once, as it was."""

from __future__ import annotations

from orchestrator.node.watch.screen import MAX_ROWS, SETTLE, Screen


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def settled(screen: Screen, clock: Clock) -> bytes:
    """What two whole SETTLE periods later have made done."""
    out = b""
    for _ in range(2):
        clock.now += SETTLE
        out += screen.settle()
    return out


def test_plain_lines_take_the_fast_path_byte_for_byte():
    screen = Screen(Clock())
    assert screen.feed(b"a\nb\xff\x9b[2J\nunfinished") == b"a\nb\xff\x9b[2J\n"
    assert screen.rows == [] and screen.live() == []
    assert screen.feed(b" still\n") == b"unfinished still\n"
    assert screen.end() == b""


def test_a_bar_is_live_while_drawn_and_its_final_state_one_line():
    clock = Clock()
    screen = Screen(clock)
    out = b"".join(screen.feed(b"\r %3d%%|##  | %d/100 [00:01<00:09, 10.00it/s]" % (i, i)) for i in range(100))
    assert out == b""
    assert screen.changed and screen.live() == ["  99%|##  | 99/100 [00:01<00:09, 10.00it/s]"]
    assert not screen.changed
    out = screen.feed(b"\r100%|####| 100/100 [00:10<00:00, 10.00it/s]   \n")
    assert out == b"100%|####| 100/100 [00:10<00:00, 10.00it/s]\n"  # padding gone, one line
    assert screen.feed(b"done\n") == b"done\n"
    assert settled(screen, clock) == b"" and screen.rows == []  # back on the fast path


def test_a_bar_ends_at_its_newline_before_the_next_line():
    clock = Clock()
    screen = Screen(clock)
    assert screen.feed(b"\rbar 1\rbar 2\nafter\n") == b"bar 2\nafter\n"
    assert settled(screen, clock) == b"" and screen.rows == []


def test_print_with_end_cr_keeps_its_last_number_and_a_cleared_bar_is_dropped():
    clock = Clock()
    screen = Screen(clock)
    screen.feed(b"1\r2\r3\r")
    assert screen.live() == ["3"]
    screen.feed(b"\r" + b" " * 40 + b"\r")  # tqdm(leave=False) clears its row
    assert screen.live() == []  # cleared: blanks are the last piece drawn
    assert screen.feed(b"done\n") == b"done\n"


def test_a_bar_cleared_with_blanks_leaves_no_empty_line():
    clock = Clock()
    screen = Screen(clock)
    screen.feed(b"\rbar 50%\r        \r")
    assert screen.end() == b""
    screen = Screen(clock)
    assert screen.feed(b"\rbar\r     \n") == b""


def test_tqdm_nested_bars_are_two_live_rows_and_write_lines_come_out():
    clock = Clock()
    screen = Screen(clock)
    out = screen.feed(b"\router:   0%|   | 0/3\n\rinner:   0%|   | 0/2\x1b[A")
    out += screen.feed(b"\n\rinner:  50%|#  | 1/2\x1b[A")
    assert screen.live() == ["outer:   0%|   | 0/3", "inner:  50%|#  | 1/2"]
    # tqdm.write: clear both rows, the message, the bars again one row lower
    out += screen.feed(b"\n\r" + b" " * 20 + b"\x1b[A\r" + b" " * 20 + b"\rmsg\n")
    out += screen.feed(b"\router:  33%|#  | 1/3\n\rinner:   0%|   | 0/2\x1b[A")
    out += settled(screen, clock)
    assert out == b"msg\n"
    assert screen.live() == ["outer:  33%|#  | 1/3", "inner:   0%|   | 0/2"]
    out = screen.feed(b"\router: 100%|###| 3/3\n") + settled(screen, clock)
    assert out == b"outer: 100%|###| 3/3\n"
    assert screen.end() == b"inner:   0%|   | 0/2\n"


def test_the_first_step_down_and_up_in_two_reads_costs_one_line_then_rows_hold():
    clock = Clock()
    screen = Screen(clock)
    out = screen.feed(b"\router 0/3\n")
    out += screen.feed(b"\rinner 0/2\x1b[A")
    out += screen.feed(b"\router 1/3\n\rinner 1/2\x1b[A") + settled(screen, clock)
    assert out == b"outer 0/3\n"
    assert screen.live() == ["outer 1/3", "inner 1/2"]


def test_a_read_cut_between_the_step_down_and_the_step_up_loses_no_bar():
    clock = Clock()
    screen = Screen(clock)
    screen.feed(b"\router 0/3\n\rinner 0/2\x1b[A")
    out = screen.feed(b"\router 1/3\n")  # tqdm's "\n", then its bar and "ESC[A" in the next read
    clock.now += SETTLE / 2
    out += screen.settle()
    out += screen.feed(b"\rinner 1/2\x1b[A")
    out += settled(screen, clock)
    assert out == b"" and screen.live() == ["outer 1/3", "inner 1/2"]


def test_rows_live_at_once_are_bounded():
    clock = Clock()
    screen = Screen(clock)
    out = screen.feed(b"\x1b[A" + b"".join(b"\rline %d\n" % i for i in range(100)))  # cursor-up: rows
    assert len(screen.rows) <= MAX_ROWS + 1
    assert out.splitlines()[:3] == [b"line 0", b"line 1", b"line 2"]
    assert (out + screen.end()).count(b"\n") == 100


def test_a_bar_that_never_returns_is_cut_into_lines():
    screen = Screen(Clock())
    out = screen.feed(b"\r" + b"x" * (3 << 20))
    assert out.count(b"\n") == 1 and len(out) > (1 << 20)


def test_the_unterminated_end_of_a_plain_stream_stays_unterminated():
    clock = Clock()
    screen = Screen(clock)
    assert screen.feed(b"\rbar\nno newline") == b"bar\n"
    assert screen.end() == b"no newline"


def test_a_256_color_escape_takes_no_room_and_leaves_no_text():
    """Rich draws with ESC[38;5;197m: read as one escape, not as ESC and then "[38;5;197m" text."""
    screen = Screen(clock=lambda: 0.0)
    out = screen.feed(b"\r\x1b[2Ktrain \x1b[38;5;197m\xe2\x94\x81\x1b[0m 1/4\r\x1b[2Ktrain \x1b[38;5;70m\xe2\x94\x81\xe2\x94\x81 4/4\n")
    assert out + screen.end() == "train ━━ 4/4\n".encode()
