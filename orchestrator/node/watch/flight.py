"""The job's collectives as torch's Flight Recorder keeps them: recording on, each rank's record
read here, and what of it goes to the controller.

Every rank keeps a ring of its last collectives (op, process group, sequence number, sizes,
dtypes, when it was called, whether it completed) once its buffer size is set:
``recording_env`` sets the one variable the node's torch reads (``buffer_var``), where the job's
environment sets neither. A thread the rank hook starts in each rank (userpython/rankhook.py)
writes the rank's record as JSON (never torch's pickle) into this attempt's private directory
every RECORD_EVERY seconds, at the same wall-clock instants on every rank, so that the records
of all ranks overlap. A rank that hangs wrote its stuck state the moment it got stuck; one that
dies of a collective timeout leaves its last record behind.

Those files are the job's bytes: read as JSON only, bounded in size, every field checked. Two
frames carry them on: ``Collectives`` (each rank's last SNAPSHOT entries: after a stack dump and
at the attempt's end; the controller names the stuck collective from them) and ``Arrivals``
(while the job runs: when this node's last rank reached each collective; the controller compares
the nodes and names a straggler).
"""

import json
import os
import re
import time

from ..local.state import open_regular
from ..protocol import wire
from ..userpython.rankhook import (DIR_VAR, EVERY_VAR, RECORDER_FRAME, RECORDER_THREAD)  # (the recorder: the rank hook's thread)

BUFFER = "256"  # entries each rank keeps: a ring, so its cost does not grow with the run
RECORD_EVERY = 5.0  # seconds between a rank's records (aligned to the wall clock on every rank)
SNAPSHOT = 16  # a rank's last entries sent for a diagnosis
ARRIVALS_MAX = 64  # collectives per Arrivals frame (a sample: a straggler is late at most of them)
RECORD_MAX = 4 << 20  # bytes of one record file read; a bigger one is not ours
NAME_MAX = 64  # characters of a name (op, group) kept
RECORD_FILE = re.compile(r"(fr|nccl)\.(\d{1,7})\.json")
UP_FILE = re.compile(r"up\.(\d{1,7})")  # an empty file: that rank's process group is up (its hang clock starts)
BUFFER_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")  # the name since torch 2.9, the name before
RENAMED_IN = (2, 9)


def buffer_var(torch_version):
    """The buffer variable the node's torch reads. torch 2.9 renamed TORCH_NCCL_TRACE_BUFFER_SIZE
    to TORCH_FR_BUFFER_SIZE and prints a deprecation warning in every rank that still sets the old
    name (seen with NCCL on torch 2.11, and with gloo on 2.13), so only one is set: the old name
    for a torch known to be older, the new one otherwise (``launcher: none`` probes no version)."""
    found = re.match(r"(\d+)\.(\d+)", torch_version or "")
    if found and (int(found.group(1)), int(found.group(2))) < RENAMED_IN:
        return BUFFER_VARS[1]
    return BUFFER_VARS[0]


def recording_env(env, directory, torch_version=None):
    """The job's environment with the Flight Recorder on, where the job did not set it itself
    (a user's own buffer size, or 0 for off, under either name, is kept), and this attempt's
    record directory."""
    if not any(var in env for var in BUFFER_VARS):
        env[buffer_var(torch_version)] = BUFFER
    # NCCL's own dump when its watchdog times out (torch's pickle, for torch's analyzer; never read
    # here): into the private directory, not /tmp, where another user could plant a link
    env.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    env.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", os.path.join(directory, "nccl_trace_rank_"))
    env.setdefault("TORCH_FR_DUMP_TEMP_FILE", os.path.join(directory, "fr_trace_rank_"))
    env[DIR_VAR] = directory
    env[EVERY_VAR] = str(RECORD_EVERY)
    return env


def _name(value):
    return value[:NAME_MAX] if isinstance(value, str) else "?"


def _number(value):
    """An int as JSON gives it, within 64 bits: a 400-digit one is not torch's (and broke arithmetic)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and -(1 << 63) <= value < 1 << 63 else None


def _shapes(value):
    """Sizes ([[4], [2, 4]]) or dtypes (["Float"]) as JSON-safe, bounded values."""
    if not isinstance(value, list):
        return []
    return [v[:NAME_MAX] if isinstance(v, str) else [d for d in v[:8] if _number(d) is not None]
            if isinstance(v, list) else None for v in value[:8]]


def compact(entry):
    """One Flight Recorder entry as the frames carry it: [group name, group description, sequence
    number, op, done, input sizes, input dtypes, output sizes, output dtypes, called (ns, wall
    clock)]; None for a point-to-point entry or one that is not an entry at all."""
    if not isinstance(entry, dict) or entry.get("is_p2p") is not False:
        return None
    seq = _number(entry.get("collective_seq_id"))
    group = entry.get("process_group")
    if seq is None or not isinstance(group, list) or len(group) != 2:
        return None
    op = _name(entry.get("profiling_name"))
    done = entry.get("retired") is True or entry.get("state") == "completed"
    return [_name(group[0]), _name(group[1]), seq, op.split(":", 1)[-1], done,
            _shapes(entry.get("input_sizes")), _shapes(entry.get("input_dtypes")),
            _shapes(entry.get("output_sizes")), _shapes(entry.get("output_dtypes")),
            _number(entry.get("time_created_ns"))]


def read_records(directory):
    """{rank: [compact entries, oldest first]} from the record files in ``directory``; a file
    that is not a record (too big, not JSON, odd fields) is left out, never an error."""
    records = {}
    try:
        names = os.listdir(directory)
    except OSError:
        return records
    for name in sorted(names):
        m = RECORD_FILE.fullmatch(name)
        if m is None:
            continue
        entries = read_entries(os.path.join(directory, name))
        if entries:
            records.setdefault(int(m.group(2)), []).extend(entries)
    return records


def read_entries(path):
    fd = open_regular(path)  # the ranks' directory: a FIFO or a link there is not a record
    if fd is None:
        return []
    try:
        with os.fdopen(fd, "rb") as f:
            data = f.read(RECORD_MAX + 1)
        record = json.loads(data) if len(data) <= RECORD_MAX else None
    except (OSError, ValueError, RecursionError):
        return []
    entries = record.get("entries") if isinstance(record, dict) else None
    if not isinstance(entries, list):
        return []
    return [c for c in map(compact, entries[-int(BUFFER) * 4:]) if c is not None]


def ranks_up(directory, seen):
    """The ranks whose process group came up since ``seen`` (a set, updated): names only, never
    a file opened (the directory is the ranks' to write)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = {int(m.group(1)) for m in map(UP_FILE.fullmatch, names) if m} - seen
    seen.update(found)
    return sorted(found)


def snapshot(records):
    """The Collectives frame: each rank's last SNAPSHOT entries."""
    return wire.Collectives(ranks={str(rank): entries[-SNAPSHOT:] for rank, entries in sorted(records.items())})


class ArrivalWatch:
    """What of this node's records the controller has not had yet, as Arrivals: for each
    collective that every rank here has called, when the last of them did and which rank that
    was. A collective that some rank here has not called yet waits for the next read."""

    def __init__(self, ranks):
        self.ranks = ranks  # how many ranks this node has
        self.sent = {}  # {(group, seq): None}: insertion-ordered, the oldest dropped past a bound

    def arrivals(self, records):
        if len(records) < self.ranks:
            return None
        called = {}  # {(group, seq): {rank: when it called it}}
        for rank, entries in records.items():
            for e in entries:
                if e[9] is not None and (e[0], e[2]) not in self.sent:
                    called.setdefault((e[0], e[2]), {})[rank] = e[9]
        new = sorted((key, max((ns, rank) for rank, ns in by_rank.items()))
                     for key, by_rank in called.items() if len(by_rank) == self.ranks)[-ARRIVALS_MAX:]
        for key, _ in new:
            self.sent[key] = None
        while len(self.sent) > 16 * ARRIVALS_MAX:
            del self.sent[next(iter(self.sent))]
        return wire.Arrivals(times=[[group, seq, ns / 1e9, rank] for (group, seq), (ns, rank) in new]) if new else None


class RecorderFilter:
    """A rank's stderr less ddp-up's own recorder thread in its stack dumps: faulthandler's block
    whose innermost frame is the recorder's, py-spy's block of the recorder's name. The user is
    shown the rank's own threads (the stack reader skips the recorder too). Linear in what it is
    fed, one line held at most; a chunk with no dump in it passes as it is."""

    HEADER = re.compile(rb"Thread 0x[0-9a-fA-F]+ \(most recent call first\):")  # faulthandler's
    OURS = re.compile(rb'  File ".*sitecustomize\.py", line \d+ in %s' % RECORDER_FRAME.encode())
    SPY_OURS = re.compile(rb'Thread \d+ \([\w ]+\): "%s"' % RECORDER_THREAD.encode())  # py-spy's

    def __init__(self):
        self.held = None  # a faulthandler thread's header, until its first frame says whose thread it is
        self.skipping = False  # inside the recorder's block: until its blank line or the next thread
        self.partial = b""  # the unfinished end of what was fed, where it may begin a header

    def feed(self, data):
        tail = data[data.rfind(b"\n") + 1:]  # where a header may begin, cut at the chunk's end
        if self.held is None and not self.skipping and not self.partial and b"Thread " not in data and not \
                may_begin_header(tail):
            return data
        *lines, rest = (self.partial + data).split(b"\n")
        out = [line + b"\n" for line in map(self.line, lines) if line is not None]
        unsure = self.skipping or self.held is not None or may_begin_header(rest)
        self.partial = rest if unsure and len(rest) < 256 else b""
        return b"".join(out) + (b"" if self.partial else rest)

    def line(self, line):
        """The line to pass on, or None (the recorder's, or held)."""
        if self.skipping:
            if line and not line.startswith((b"Thread ", b"Current thread ")):
                return None
            self.skipping = False
            if not line:
                return None  # the block's blank line goes with it
        if self.held is not None:
            held, self.held = self.held, None
            if self.OURS.fullmatch(line):
                self.skipping = True
                return None
            line = held + b"\n" + line
        if self.HEADER.fullmatch(line):
            self.held = line
            return None
        if self.SPY_OURS.fullmatch(line):
            self.skipping = True
            return None
        return line

    def flush(self):
        """What is held, at the stream's end."""
        held = (self.held + b"\n" if self.held is not None else b"") + (b"" if self.skipping else self.partial)
        self.held, self.partial, self.skipping = None, b"", False
        return held


def may_begin_header(fragment):
    """Whether the unfinished end of a chunk may be the start of a thread's header in a dump."""
    return bool(fragment) and b"Thread ".startswith(fragment[:7])


def without_recorder(text):
    """A whole dump (py-spy's, as ddp-up prints it into a rank's stderr) less the recorder's thread."""
    ours = RecorderFilter()
    return ours.feed(text) + ours.flush()


UP_EVERY = 0.5  # seconds between looks for the ranks whose process group came up, until all have


def watch(ended, out, flight_dir, nproc):
    """Until ``ended``: which of this node's ranks have their process group up (RanksUp: their hang
    clocks start), then when they reached their collectives (Arrivals), read halfway between two
    of the ranks' records (they write them at the same instants)."""
    up = set()
    while len(up) < (nproc or 1) and not ended.wait(UP_EVERY):
        found = ranks_up(flight_dir, up)
        if found:
            out.send(wire.RanksUp(ranks=found), block=False)
    seen = ArrivalWatch(nproc or 1)
    every = RECORD_EVERY
    while not ended.wait(every - (time.time() - every / 2) % every):
        frame = seen.arrivals(read_records(flight_dir))
        if frame is not None and not ended.is_set():
            out.send(frame, block=False)
