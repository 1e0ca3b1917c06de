"""A worker's stream as a terminal shows it: lines that end, and lines that change.

Progress bars (tqdm, the Hugging Face Trainer, Lightning) rewrite one line with ``\\r``; tqdm's
nested bars step down a row (``\\n``), draw, and step back up (``ESC [ A``). Read as lines, a bar
is an hour of nothing and then one line of megabytes. A Screen reads the bytes as a terminal
would, keeping the rows still being drawn (``live``: the bars) apart from the lines that are done
(``feed``/``settle``/``end`` return them, as bytes ending in ``\\n``, for Output frames).

* The model is a terminal's: rows of characters and a cursor. Text overwrites from the cursor's
  column; ``\\r`` goes to column 0; ``\\n`` to the next row's column 0 (a terminal's newline
  translation, as a pty has it); ``ESC [ n A`` / ``B`` up and down, the column kept; ``ESC [ K``
  (``0K``, ``2K``) erases; ``ESC [ n G`` sets the column; other escapes (colors, the cursor's
  visibility) take no room and are left out. So what a row holds is what a terminal shows on it:
  ``print(i, end="\\r")`` leaves its last number, a new line drawn on a row a bar cleared with
  blanks starts at column 0, and two bars never share a row.
* A finished row that a ``\\r`` or a cursor move touched loses its trailing blanks, and one left
  blank is dropped, not sent as an empty line. A row no ``\\r`` or move touched goes out as it
  was written, byte for byte.
* In a stream that never moved the cursor up, a line is done at its ``\\n``, at once, bar or
  not: a bar's last state comes before what the rank prints after it. Text without ``\\r`` or
  escapes, with no bar live, takes the fast path: the bytes as they are.
* A stream that moves the cursor up (tqdm's nested bars) is read as rows to its end: a row is
  done once the cursor stayed below it for SETTLE seconds (tqdm's ``\\n`` to the row below and
  its step back up may come in two reads). At most MAX_ROWS rows are kept live. (Where the very
  first step down and step up come in two reads, the outer bar's first state is one line.)

Text is decoded incrementally (a character cut between two reads waits for its end), bytes that
are not UTF-8 kept as they were; every parse is linear and bounded (an escape's number has at most
four digits, a row at most MAX_PIECE characters).
"""

import codecs
import re
import time

SETTLE = 0.15  # seconds the cursor stays below a row before it counts as done
MAX_ROWS = 16
MAX_PIECE = 1 << 20  # a line longer than this goes out in pieces (the controller joins them again)
# the tokens a screen acts on: a newline, a carriage return, a CSI escape (bounded: at most 32
# digits and separators, "38;5;197" for a 256-color; anything longer is not read as one), or text
_TOKENS = re.compile(r"\n|\r|\x1b\[([?]?)([0-9;]{0,32})([@-~])|\x1b|[^\n\r\x1b]+")
_UP = re.compile(rb"\x1b\[[0-9]{0,4}A")
_PARTIAL = re.compile(r"\x1b(\[[?]?[0-9;]{0,32})?\Z")  # an escape the read cut short: kept for the next one
_SCREEN = re.compile(rb"\r|\x1b\[[0-9]{0,4}[AB]")  # what takes a stream off the fast path: a bar, a cursor move


def whole_lines(buffered, flush):
    """Split ``buffered`` bytes into (what to send now, what to keep): whole lines, all of a line
    past MAX_PIECE, and everything at the end (``flush``). Nothing is added or dropped."""
    cut = buffered.rfind(b"\n") + 1
    if flush or (cut == 0 and len(buffered) >= MAX_PIECE):
        cut = len(buffered)
    return buffered[:cut], buffered[cut:]


class Row:
    __slots__ = ("text", "raw", "touched")

    def __init__(self):
        self.text = ""  # what a terminal shows on this row
        self.raw = []  # while untouched: everything written to it, escapes (colors) too, as written
        self.touched = False  # a \r, an erase, a cursor move or an overwrite touched it

    def put(self, column, text):
        """``text`` over the row from ``column`` (blanks up to it where the row is shorter)."""
        row = self.text
        if column != len(row):
            self.touched = True
        if column > len(row):
            row += " " * (column - len(row))
        self.text = row[:column] + text + row[column + len(text):]
        self.keep(text)

    def keep(self, text):
        if not self.touched:
            self.raw.append(text)

    def line(self):
        """The row as a line that is done, or "" when it was left blank."""
        if not self.touched:
            return "".join(self.raw) + "\n"
        text = self.text.rstrip(" ")
        return text + "\n" if text else ""


class Screen:
    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.partial = b""  # the fast path's unfinished line
        self.rows = []  # live rows, top first; empty on the fast path
        self.cursor = 0  # index in rows
        self.column = 0  # the cursor's column on its row
        self.moved_up = False  # the stream used cursor-up: read as a screen to its end
        self.changed = False  # the live rows changed since ``live`` was last read
        self.epoch = clock()  # SETTLE: rows above `lowest` since `epoch` are done at its end
        self.lowest = 0
        self.decoder = None  # UTF-8, incremental, on the screen path
        self.held = ""  # the start of an escape cut short by the end of a read

    def feed(self, data):
        """Bytes read from the stream; the lines now done."""
        if not self.rows and _SCREEN.search(data) is None:
            send, self.partial = whole_lines(self.partial + data, flush=False)
            return send
        if not self.rows:
            self.decoder = codecs.getincrementaldecoder("utf-8")("surrogateescape")
            self.rows, self.cursor, self.column, self.lowest = [Row()], 0, 0, 0
            data, self.partial = self.partial + data, b""
        out = []
        self.moved_up = self.moved_up or _UP.search(data) is not None  # before its \n: tqdm's step down
        text = self.held + self.decoder.decode(data)
        cut = _PARTIAL.search(text)
        text, self.held = (text[:cut.start()], text[cut.start():]) if cut else (text, "")
        for token in _TOKENS.finditer(text):
            self.act(token, out)
        self.changed = True
        return encoded(out)

    def act(self, token, out):
        text = token.group()
        if text == "\n":
            self.down(out)
        elif text == "\r":
            self.column = 0
            self.rows[self.cursor].touched = True
        elif text.startswith("\x1b"):
            first = (token.group(2) or "").split(";")[0][:4]  # the first parameter: a count, a mode
            self.escape(first, token.group(3), text)
        else:
            self.draw(text, out)

    def escape(self, number, final, text):
        n = int(number or 1)
        row = self.rows[self.cursor]
        if final == "A" and not text.startswith("\x1b[?"):  # a cursor move, not a private mode
            self.up(n)
        elif final == "B":
            for _ in range(min(n, MAX_ROWS)):
                self.step_down()
        elif final == "K":  # erase: to the end (0), to the start (1), the whole row (2)
            row.touched = True
            row.text = row.text[:self.column] if n != 2 and number in ("", "0") else \
                (" " * self.column + row.text[self.column:] if number == "1" else "")
        elif final == "G":
            self.column = max(0, n - 1)
            row.touched = True
        else:  # colors and the like: no room on the row; kept where the row is still as written
            row.keep(text)

    def draw(self, text, out):
        row = self.rows[self.cursor]
        row.put(self.column, text)
        self.column += len(text)
        if len(row.text) > MAX_PIECE:  # a bar that never returns: its text goes as a line of its own
            out.append(row.text + "\n")
            self.rows[self.cursor], self.column = Row(), 0

    def down(self, out):
        """A newline: the next row, at column 0."""
        self.column = 0
        if not self.moved_up:  # one row: done at its \n, bar or not
            out.append(self.rows[0].line())
            self.rows[0] = Row()
            return
        self.step_down()
        if self.cursor > MAX_ROWS:
            self.commit(self.cursor - MAX_ROWS, out)

    def step_down(self):
        self.cursor += 1
        if self.cursor == len(self.rows):
            self.rows.append(Row())
        self.rows[self.cursor].touched = True

    def up(self, n):
        self.moved_up = True
        self.cursor = max(0, self.cursor - n)
        self.rows[self.cursor].touched = True
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
        if self.cursor == 0 and len(self.rows) == 1 and not self.rows[0].text and not self.moved_up and not self.held:
            self.partial = self.decoder.getstate()[0]  # a character cut between reads: its first bytes
            self.rows, self.decoder = [], None  # nothing live: back to the fast path
        return encoded(out)

    def end(self):
        """The stream is over: every row as it stands (a last row that is no bar, unfinished as
        it was written: the unterminated end of the stream)."""
        if not self.rows:
            send, self.partial = self.partial, b""
            return send
        out = []
        last = self.rows.pop()
        self.commit(len(self.rows), out)
        pending = self.held + self.decoder.decode(b"", final=True)  # what the stream cut short, as it was
        if pending:
            last.put(self.column, pending)
        out.append(last.line() if last.touched else "".join(last.raw))
        self.rows, self.cursor, self.decoder, self.held = [], 0, None, ""
        return encoded(out)

    def live(self):
        """The rows being drawn, as text, blanks left out ([] when none): for a Bars frame."""
        self.changed = False
        return [text for text in (encoded([row.text.rstrip(" ")]).decode("utf-8", "replace") for row in self.rows)
                if text]


def encoded(texts):
    """The done lines' text as the bytes the stream wrote (what was not UTF-8 comes back as it was)."""
    return "".join(texts).encode("utf-8", "surrogateescape")
