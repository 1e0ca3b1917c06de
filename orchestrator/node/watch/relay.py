"""Output to the controller: one writer thread owns stdout; the launcher's own streams and the
workers' log files are relayed through it in whole lines.

Worker output: torchrun redirects every worker's stdout/stderr to files (``--redirects=3``) and
the Tailer relays them in chunks. Workers write to a local file exactly as if nobody watched, a
slow controller never blocks them, the files are the node's own copy of the log, and the node
spends no per-line work (torchrun's ``--tee`` re-prints every line from a Python thread).
"""

import errno
import os
import queue
import threading
import time

from ..local.state import open_regular
from ..protocol import wire
from .flight import RecorderFilter
from .screen import Screen, whole_lines


class Writer:
    """One thread owns stdout, so the main loop never blocks on a stalled connection."""

    def __init__(self, stream):
        self.stream = stream
        self.items = queue.Queue(maxsize=4096)
        # frames queued and not yet written (or dropped: the stream broken). Counted before a frame
        # is queued, so a drain never sees none left while one is on its way in: an Event set when
        # the queue looked empty let a one-shot agent exit before its last frame (ddp-kill's Swept)
        self.unwritten = 0
        self.written = threading.Condition()
        self.broken = False
        self.last_activity = time.monotonic()  # last line queued or written
        threading.Thread(target=self._loop, name="writer", daemon=True).start()

    journal = None  # detach: a Journal that keeps every frame after Go (heartbeats aside; bars thinned)
    last_output = time.monotonic()  # when a rank's line last went out (a detached job's hang watch)
    begun = None  # detach: this node's ranks (local) that have begun: a line, a bar, their process group up
    first_rank = 0  # detach: this node's first global rank (RanksUp names global ranks)
    secrets = ()  # detach: values masked in every frame journaled (and sent with it), longest first

    peers = None  # detach: a callable that gets every Arrivals too (the supervisor's straggler watch)
    launcher = None  # a callable that gets the launcher's own output (the attempt's report.ReportReader.feed)

    def send(self, frame, block=True):
        if self.peers is not None and type(frame) is wire.Arrivals:
            self.peers(frame)
        if self.launcher is not None and type(frame) is wire.Output and frame.rank is None:
            self.launcher(frame.data)
        if self.journal is not None and self.secrets and not isinstance(frame, wire.Heartbeat):
            frame = masked_frame(frame, self.secrets)
        data = frame.encode()
        if (type(frame) is wire.Output and frame.rank is not None) or type(frame) is wire.Bars:
            self.last_output = time.monotonic()  # a bar that moves is progress
        if self.begun is not None and type(frame) in (wire.Output, wire.Bars, wire.RanksUp):
            self.note_begun(frame)
        journal = self.journal
        if journal is None or isinstance(frame, (wire.Heartbeat, wire.Arrivals)):
            self.put(data, block)
            return
        with journal.lock:  # one order for the file and the stream
            if type(frame) is not wire.Bars:
                journal.append(data)
            elif self.journal_bars(frame):
                journal.append(data, is_bars=True)
            if type(frame) is wire.Bars:
                journal.keep_bars(frame.bars)  # after its journaling: the bars file counts it
            self.put(data, block)

    def note_begun(self, frame):
        """A rank's first sign of life: its hang clock starts (until every rank's has, start-up's
        limit counts: policy.startup_limit), as ddp-up's HangWatch starts it."""
        if type(frame) is wire.Output:
            ranks = () if frame.rank is None else (frame.rank,)
        elif type(frame) is wire.Bars:
            ranks = [bar[1] for bar in frame.bars]
        else:
            ranks = [rank - self.first_rank for rank in frame.ranks]
        for rank in ranks:
            if rank not in self.begun:
                self.begun.add(rank)
                self.last_output = time.monotonic()  # a process group that came up is a sign of life

    JOURNAL_BARS_EVERY = 10.0  # a detached job's journal keeps its bars at most this often (and each clearing)
    bars_journaled = float("-inf")

    def journal_bars(self, frame):
        """Whether a frame goes to the journal: not every Bars (4 a second would grow it by
        megabytes a day), but one every JOURNAL_BARS_EVERY seconds, and every one that clears."""
        if type(frame) is not wire.Bars:
            return True
        now = time.monotonic()
        if now - self.bars_journaled >= self.JOURNAL_BARS_EVERY or not any(bar[2] for bar in frame.bars):
            self.bars_journaled = now
            return True
        return False

    def put(self, data, block=True):
        self.last_activity = time.monotonic()
        while not self.broken:  # gone (or given up on: a detached job's silent controller): nothing more is queued
            self._count(1)
            try:
                self.items.put(data, block=block, timeout=1.0 if block else None)
                return
            except queue.Full:
                self._count(-1)  # not queued after all
                if not block:
                    return  # only heartbeats are sent without blocking; a dropped one is harmless

    def _count(self, frames):
        with self.written:
            self.unwritten += frames
            if not self.unwritten:
                self.written.notify_all()

    def drain(self, stall_timeout):
        """Wait until everything queued is written, as long as writing makes progress."""
        with self.written:
            while self.unwritten:
                self.written.wait(0.5)
                if self.unwritten and time.monotonic() - self.last_activity > stall_timeout:
                    return False
        return True

    def _loop(self):
        while True:
            chunks = [self.items.get()]
            while True:
                try:
                    chunks.append(self.items.get_nowait())
                except queue.Empty:
                    break
            if not self.broken:
                try:
                    self.stream.write(b"".join(chunks))
                    self.stream.flush()
                    self.last_activity = time.monotonic()
                except OSError:
                    self.broken = True  # controller gone; stdin EOF will stop the job
            self._count(-len(chunks))


def masked(value, secrets):
    """A frame's field with every secret value in it (``secrets``: longest first) as ***."""
    if isinstance(value, str):
        for secret in secrets:
            value = value.replace(secret, "***")
    elif isinstance(value, bytes):
        for secret in secrets:
            value = value.replace(secret.encode("utf-8", "surrogateescape"), b"***")
    elif isinstance(value, list):
        value = [masked(v, secrets) for v in value]
    elif isinstance(value, dict):
        value = {k: masked(v, secrets) for k, v in value.items()}
    return value


def masked_frame(frame, secrets):
    return type(frame)(**{name: masked(getattr(frame, name), secrets) for name in frame.NAMES})


def join_while_moving(thread, writer, stall_timeout):
    """Wait for a relaying thread to end, as long as the writer keeps making progress."""
    while thread.is_alive():
        thread.join(0.5)
        if time.monotonic() - writer.last_activity > stall_timeout:
            return


def pump(fd, stream, writer):
    """Relay the launcher's own stream to the controller: the whole lines of each read, one frame."""
    rest = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError as e:
            if e.errno == errno.EINTR:
                continue
            chunk = b""
        send, rest = whole_lines(rest + chunk, flush=not chunk)
        if send:
            writer.send(wire.Output(stream, None, send))
        if not chunk:
            os.close(fd)
            return


def subdirs(path, keep):
    try:
        with os.scandir(path) as entries:
            return [e.path for e in entries if keep(e.name) and e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def attempt_dirs(log_dir):
    """(run, attempt) directories of torchrun's layout under log_dir (``<run>/attempt_<n>/``;
    launcher: none's too). Walked level by level, not glob: glob (with fnmatch) is a tenth of the
    agent's imports."""
    return [(run, attempt) for run in subdirs(log_dir, lambda name: True)
            for attempt in subdirs(run, lambda name: name.startswith("attempt_"))]


def rank_dirs(attempt):
    """{local rank: its directory} in one attempt directory."""
    ranks = subdirs(attempt, lambda name: name.isascii() and name.isdigit())
    return {int(os.path.basename(rank)): rank for rank in ranks}


def worker_logs(log_dir):
    """(path, stream, local rank) of every ``<run>/attempt_<n>/<local_rank>/std{out,err}.log``
    under log_dir."""
    found = []
    for _, attempt in attempt_dirs(log_dir):
        for local_rank, rank in rank_dirs(attempt).items():
            for name, stream in (("stdout.log", "out"), ("stderr.log", "err")):
                path = os.path.join(rank, name)
                if os.path.isfile(path):
                    found.append((path, stream, local_rank))
    return found


class Tailer:
    """Relays the workers' log files to the controller in whole-line chunks, one per read, and
    what their progress bars show now (Bars, at most BARS_EVERY apart: node/watch/screen.py).

    The files are torchrun's ``<log_dir>/<run>/attempt_<n>/<local_rank>/std{out,err}.log``.
    Polled, not watched: inotify is not in the stdlib, and a poll every POLL seconds costs
    nothing next to a print-heavy job while batching its lines into few frames.
    """

    POLL = 0.05
    RESCAN = 0.5  # new attempts (restarts) appear rarely
    CHUNK = 1 << 16
    BACKLOG = 32  # frames queued to the controller before reading pauses (bounds memory)
    BARS_EVERY = 0.25  # seconds between Bars frames: the dashboard redraws 4 times a second

    def __init__(self, log_dir, writer, clock=time.monotonic):
        self.log_dir = log_dir
        self.out = writer
        self.clock = clock
        self.files = {}  # path -> [fd, stream, local_rank, Screen]
        self.bars_sent = 0.0
        self.died = None  # why the relay stopped, if it did (run.finish makes it the node's failure)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, name="tailer", daemon=True)

    def start(self):
        self.thread.start()

    def finish(self, stall_timeout):
        """After the workers are gone: relay what is left, as long as relaying makes progress."""
        self.done.set()
        join_while_moving(self.thread, self.out, stall_timeout)

    def run(self):
        """The relay's loop; should anything in it fail (a bug: the job's bytes never raise), it
        says so in the node's output and on ``died``, and the run counts as failed (run.finish)."""
        try:
            self.loop()
        except Exception as e:  # noqa: BLE001 - whatever it is, it must not pass in silence
            self.died = "the relay of this node's rank output stopped (%s: %s)" % (type(e).__name__, str(e)[:200])
            self.out.send(wire.Output("err", None, ("ddp-up: %s; the run counts as failed\n" % self.died).encode()))

    def loop(self):
        scanned = 0.0
        while True:
            last = self.done.is_set()  # read before the final pass, so nothing written before it is missed
            if last or time.monotonic() - scanned > self.RESCAN:
                self.scan()
                scanned = time.monotonic()
            moved = self.relay_all(flush=last)
            self.send_bars(last)
            if last:
                return
            if not moved:
                self.done.wait(self.POLL)

    def scan(self):
        for path, stream, local_rank in worker_logs(self.log_dir):
            if path not in self.files:
                fd = open_regular(path)
                if fd is not None:
                    self.files[path] = [fd, stream, local_rank, Screen(self.clock), RecorderFilter()]

    def relay_all(self, flush):
        moved = False
        for entry in self.files.values():
            moved = self.relay(entry, flush) or moved
        return moved

    def relay(self, entry, flush):
        fd, stream, local_rank, screen, ours = entry
        shown = ours.feed if stream == "err" else bytes  # stack dumps go to stderr: ddp-up's recorder left out
        moved = False
        while True:
            while self.out.items.qsize() > self.BACKLOG and not self.out.broken:
                time.sleep(0.01)  # the controller is slower than the job: the file holds the rest
            data = os.read(fd, self.CHUNK)
            if not data:
                break
            moved = True
            self.send(stream, local_rank, shown(screen.feed(data)))
        rest = shown(screen.end() if flush else screen.settle())
        self.send(stream, local_rank, rest + ours.flush() if flush else rest)
        return moved

    def send(self, stream, local_rank, data):
        if data:
            self.out.send(wire.Output(stream, local_rank, data))

    def send_bars(self, last):
        """The bars that changed, in one frame, at most BARS_EVERY apart (and once at the end, so
        the controller forgets them)."""
        now = self.clock()
        if not last and now - self.bars_sent < self.BARS_EVERY:
            return
        bars = [[stream, local_rank, screen.live()] for _, stream, local_rank, screen, _ in self.files.values()
                if screen.changed]
        if bars:
            self.bars_sent = now
            self.out.send(wire.Bars(bars=bars))
