"""A worker's stream as a terminal shows it: lines that end, and lines that change.

Progress bars (tqdm, the Hugging Face Trainer, Lightning) rewrite one line with ``\\r``; tqdm's
nested bars step down a row (``\\n``), draw, and step back up (``ESC [ A``). Read as lines, a bar
is an hour of nothing and then one line of megabytes. A Screen reads the bytes as a terminal
would, keeping the rows still being drawn (``live``: the bars) apart from the lines that are done
(``feed``/``settle``/``end`` return them, as bytes ending in ``\\n``, for Output frames).

* A row's text is the last piece drawn on it since a ``\\r`` (the last one not empty:
  ``print(i, end="\\r")`` leaves its number, not nothing); a finished bar row loses its padding,
  and a row a bar cleared (blanks) is dropped, not sent as an empty line.
* In a stream that never moved the cursor up, a line is done at its ``\\n``, at once, bar or
  not: a bar's last state comes before what the rank prints after it. Text without ``\\r``, with
  no bar live, takes the fast path: the bytes as they are.
* A stream that moves the cursor up (tqdm's nested bars) is read as rows to its end: a row is
  done once the cursor stayed below it for SETTLE seconds (tqdm's ``\\n`` to the row below and
  its step back up may come in two reads). At most MAX_ROWS rows are kept live. (Where the very
  first step down and step up come in two reads, the outer bar's first state is one line.)

Every ``\\n``-ended line without ``\\r`` or cursor movement comes out once, byte for byte.
"""

import re
import time

SETTLE = 0.15  # seconds the cursor stays below a row before it counts as done
MAX_ROWS = 16
_MOVES = re.compile(rb"(\n|\x1b\[[0-9]*A)")
_UP = re.compile(rb"\x1b\[[0-9]*A")
MAX_PIECE = 1 << 20  # a line longer than this goes out in pieces (the controller joins them again)


def whole_lines(buffered, flush):
    """Split ``buffered`` bytes into (what to send now, what to keep): whole lines, all of a line
    past MAX_PIECE, and everything at the end (``flush``). Nothing is added or dropped."""
    cut = buffered.rfind(b"\n") + 1
    if flush or (cut == 0 and len(buffered) >= MAX_PIECE):
        cut = len(buffered)
    return buffered[:cut], buffered[cut:]


class Row:
    __slots__ = ("done", "cur", "bar")

    def __init__(self, cur=b""):
        self.done = b""  # the last piece not empty before the latest \r
        self.cur = cur  # what was drawn since the latest \r
        self.bar = False  # a \r touched it

    def shown(self):
        return self.cur or self.done

    def draw(self, text):
        """Text on this row, \\r in it or not: only the last piece not empty stays."""
        pieces = text.split(b"\r")
        pieces[0] = self.cur + pieces[0]
        if len(pieces) > 1:
            self.bar = True
            for piece in reversed(pieces[:-1]):
                if piece:
                    self.done = piece
                    break
        self.cur = pieces[-1]

    def line(self):
        """The row as a line that is done, or b"" when a bar cleared it."""
        if not self.bar:
            return self.cur + b"\n"
        text = self.shown().rstrip(b" ")
        return text + b"\n" if text else b""


class Screen:
    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.partial = b""  # the fast path's unfinished line
        self.rows = []  # live rows, top first; empty on the fast path
        self.cursor = 0  # index in rows
        self.moved_up = False  # the stream used cursor-up: read as a screen to its end
        self.changed = False  # the live rows changed since ``live`` was last read
        self.epoch = clock()  # SETTLE: rows above `lowest` since `epoch` are done at its end
        self.lowest = 0

    def feed(self, data):
        """Bytes read from the stream; the lines now done."""
        if not self.rows and b"\r" not in data and (b"\x1b[" not in data or _UP.search(data) is None):
            send, self.partial = whole_lines(self.partial + data, flush=False)
            return send
        if not self.rows:
            self.rows, self.cursor, self.lowest = [Row(self.partial)], 0, 0
            self.partial = b""
        out = []
        self.moved_up = self.moved_up or _UP.search(data) is not None  # before its \n: tqdm's step down
        for token in _MOVES.split(data):
            if token == b"\n":
                self.down(out)
            elif token.startswith(b"\x1b[") and token.endswith(b"A"):
                self.up(int(token[2:-1] or 1))
            elif token:
                self.draw(token, out)
        self.changed = True
        return b"".join(out)

    def draw(self, text, out):
        row = self.rows[self.cursor]
        row.draw(text)
        if len(row.cur) > MAX_PIECE:  # a bar that never returns: its text goes as a line of its own
            out.append(row.cur + b"\n")
            row.cur = b""

    def down(self, out):
        if not self.moved_up:  # one row: done at its \n, bar or not
            out.append(self.rows[0].line())
            self.rows[0] = Row()
            return
        self.cursor += 1
        if self.cursor == len(self.rows):
            self.rows.append(Row())
        if self.cursor > MAX_ROWS:
            self.commit(self.cursor - MAX_ROWS, out)

    def up(self, n):
        self.moved_up = True
        self.cursor = max(0, self.cursor - n)
        self.lowest = min(self.lowest, self.cursor)

    def commit(self, count, out):
        """The top ``count`` rows are done."""
        out.extend(row.line() for row in self.rows[:count])
        del self.rows[:count]
        self.cursor -= count
        self.lowest = max(0, self.lowest - count)
        self.changed = True

    def settle(self):
        """The rows the cursor stayed below for a whole SETTLE, as done lines. Called often (every
        read, and between reads)."""
        now = self.clock()
        if not self.rows or now - self.epoch < SETTLE:
            return b""
        out = []
        if self.lowest:
            self.commit(self.lowest, out)
        self.epoch, self.lowest = now, self.cursor
        if self.cursor == 0 and len(self.rows) == 1 and not self.rows[0].shown() and not self.moved_up:
            self.rows = []  # nothing live: back to the fast path
        return b"".join(out)

    def end(self):
        """The stream is over: every row as it stands (a last row that is no bar, unfinished as
        it was written: the unterminated end of the stream)."""
        if not self.rows:
            send, self.partial = self.partial, b""
            return send
        out = []
        last = self.rows.pop()
        self.commit(len(self.rows), out)
        out.append(last.line() if last.bar else last.cur)
        self.rows, self.cursor = [], 0
        return b"".join(out)

    def live(self):
        """The rows being drawn, as text, blanks left out ([] when none): for a Bars frame."""
        self.changed = False
        return [text for text in (row.shown().rstrip(b" ").decode("utf-8", "replace") for row in self.rows) if text]
