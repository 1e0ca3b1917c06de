"""What the job's failed ranks left on this node, and when: torchelastic's error file (a script
whose main is wrapped in ``@record``), else the traceback at the end of the rank's stderr log.

Their times are the files' own (the moment the rank wrote its exception, to the nanosecond);
torchrun's report says only the second. A rank that dies of a signal (the OOM killer, a
segfault) leaves no file: RankEnds sees the moment each worker ends. Both ends read these to name the root cause (policy.
earliest). Everything here is bytes the job wrote: read bounded, parsed as JSON at most, never
run or unpickled, and every text cut to a length before it travels.
"""

import json
import os
import re
import select
import threading
import time

from ..local.procs import carries, children, read_environ_value, read_tags
from ..local.state import open_regular
from .relay import attempt_dirs, rank_dirs
from .teardown import SCRIPTS_EVERY

READ_MOST = 1 << 16  # bytes read of the end of a stderr log
ERROR_FILE_MOST = 1 << 18  # bytes read of an error file (JSON is read whole, or not at all), kept for the run's logs
TRACE_LINES = 12  # the last lines of a traceback kept
LINE_MOST = 400  # characters a traceback line keeps
TRACEBACK = "Traceback (most recent call last):"


def rank_failures(log_dir, before=float("inf")):
    """[{"rank": local rank, "at": wall time, "exception": text, "trace": [lines], "error_file":
    its text or None}] of every rank of the latest attempt of each torchrun run under ``log_dir``
    that left an exception, earliest first. ``before`` (wall time): only what was written before
    then (a stop asked for at ``before`` makes ranks fail too; those are not the job's own)."""
    found = []
    for local_rank, where in latest_ranks(log_dir).items():
        failure = from_error_file(where) or from_stderr(where)
        if failure is not None and failure["at"] < before:
            failure["rank"] = local_rank
            found.append(failure)
    return sorted(found, key=lambda f: f["at"])


def latest_ranks(log_dir):
    """{local rank: its directory} in the newest ``attempt_<n>`` of every run under log_dir."""
    newest = {}
    for run, attempt in attempt_dirs(log_dir):
        number = os.path.basename(attempt)[8:]
        if number.isdigit() and int(number) >= newest.get(run, (-1, None))[0]:
            newest[run] = (int(number), attempt)
    ranks = {}
    for _, attempt in newest.values():
        ranks.update(rank_dirs(attempt))
    return ranks


def read_bounded(path, most, tail):
    """(text, mtime) of at most ``most`` bytes of a regular file (its end if ``tail``), or None.
    Never follows a link: the job's directory is the job's to write."""
    fd = open_regular(path)
    if fd is None:
        return None
    try:
        st = os.fstat(fd)
        if tail and st.st_size > most:
            os.lseek(fd, st.st_size - most, os.SEEK_SET)
        data = os.read(fd, most)
        return data.decode("utf-8", "replace"), st.st_mtime
    except OSError:
        return None
    finally:
        os.close(fd)


def from_error_file(where):
    """What torchelastic's ``@record`` wrote: {"message": {"message": "Type: text", "extraInfo":
    {"py_callstack": "..."}}}; None if there is none or it is not that shape."""
    read = read_bounded(os.path.join(where, "error.json"), ERROR_FILE_MOST, tail=False)
    if read is None:
        return None
    text, mtime = read
    try:
        message = json.loads(text)["message"]
        exception = message["message"] if isinstance(message, dict) else message
        stack = message.get("extraInfo", {}).get("py_callstack", "") if isinstance(message, dict) else ""
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if not isinstance(exception, str) or not isinstance(stack, str):
        return None
    return {"at": mtime, "exception": clip(first_line(exception)), "trace": last_lines(stack.splitlines()),
            "error_file": text}


# torch prints an uncaught exception of a rank whose process group is up with every line
# prefixed: "[rank2]: Traceback ...", "[rank2]:   File ...", and its C++ warnings as "[rank2]:[W...]".
RANK_PREFIX = re.compile(r"\[rank\d{1,7}\]: ?")
MESSAGE_MORE = 8  # lines of an exception's message after its first kept in the trace (NCCL's "Last error:")


def from_stderr(where):
    """The last traceback in the end of the rank's stderr log (torch's ``[rankN]: `` prefix or
    not): its exception line (the first line after the header that is not indented), the
    message's own last error where NCCL gives one, and its last lines; None without one."""
    read = read_bounded(os.path.join(where, "stderr.log"), READ_MOST, tail=True)
    if read is None:
        return None
    text, mtime = read
    lines = [unprefixed(line) for line in text.splitlines()]
    starts = [i for i, line in enumerate(lines) if line.startswith(TRACEBACK)]
    if not starts:
        return None
    block = lines[starts[-1]:]
    ends = [i for i, line in enumerate(block) if i and line and not line[0].isspace()]
    if not ends:
        return None
    message = message_lines(block[ends[0]:])
    block = block[:ends[0]] + message
    return {"at": mtime, "exception": clip(exception_line(message)), "trace": last_lines(block), "error_file": None}


def unprefixed(line):
    found = RANK_PREFIX.match(line)
    return line[found.end():] if found else line


def message_lines(lines):
    """The exception's line and the lines its message goes on with, up to a blank line or a log
    line of torch's own ("[W...]", "[E...]", "W1126 ..."), at most MESSAGE_MORE more."""
    kept = lines[:1]
    for line in lines[1:MESSAGE_MORE + 1]:
        if not line.strip() or line.startswith("[") or re.match(r"[WEI]\d{4} ", line):
            break
        kept.append(line)
    return kept


def exception_line(message):
    """The exception's first line, with the line after NCCL's "Last error:" where it says one
    (its first line names only the file and the error class; the reason is there)."""
    text = message[0]
    for i, line in enumerate(message[1:-1], 1):
        if line.strip() == "Last error:":
            return "%s (last error: %s)" % (text, message[i + 1].strip())
    return text


def first_line(text):
    return text.strip().splitlines()[0] if text.strip() else ""


def clip(line):
    return line if len(line) <= LINE_MOST else line[:LINE_MOST - 3] + "..."


def last_lines(lines):
    return [clip(line) for line in lines[-TRACE_LINES:]]


class RankEnds:
    """When each worker of a launch ended (wall clock, {local rank: time}). The workers are the
    launcher's children, found by their tags as they appear; a pidfd each (Linux 5.3, Python
    3.9) becomes readable when its worker is gone, so one thread sleeps in select until the
    kernel wakes it, looking for new workers every RESCAN seconds. Without pidfds there are no
    times, and torchrun's report's second stands. Once every one of ``count`` has ended, or ended
    its script (``scripts()``: the global ranks whose end watch marked it, rankhook's end watch; the
    interpreter's teardown may take a while after), ``on_all()`` (RanksEnded: the ranks' silence,
    and the launcher's at torchrun's exit barrier, is finishing, no hang)."""

    RESCAN = 1.0
    FIRST_RESCAN = 0.05  # until every worker was seen: a warm rank (forked) can be up, and gone, within a second

    def __init__(self, launcher_pid, match, count=0, on_all=lambda: None, scripts=set):
        self.launcher, self.match = launcher_pid, match
        self.count, self.on_all, self.scripts = count, on_all, scripts
        self.ended_scripts = set()  # local ranks whose scripts ended, their processes perhaps not yet
        self.local_of = {}  # global rank -> local rank, as each worker's environment says
        self.ends = {}
        self.watching = {}  # pidfd -> local rank
        self.seen = set()
        self.seen_ranks = set()  # local ranks found so far
        self.wake_r, self.wake_w = None, None
        self.thread = None

    def start(self):
        if not hasattr(os, "pidfd_open"):
            return
        self.wake_r, self.wake_w = os.pipe()
        self.thread = threading.Thread(target=self.run, name="rank-ends", daemon=True)
        self.thread.start()

    def run(self):
        while True:
            self.find()
            rescan = min(self.RESCAN if len(self.seen_ranks) >= self.count else self.FIRST_RESCAN, SCRIPTS_EVERY)
            ready = select.select([self.wake_r] + list(self.watching), [], [], rescan)[0]
            now = time.time()
            for fd in ready:
                if fd != self.wake_r:
                    self.ends[self.watching.pop(fd)] = now
                    os.close(fd)
            if not self.all_ended():
                self.ended_scripts = self.clean()
            if self.all_ended():
                self.on_all, told = (lambda: None), self.on_all  # once
                told()
            if self.wake_r in ready:
                break
        for fd in self.watching:
            os.close(fd)
        os.close(self.wake_r)

    def find(self):
        for pid in children(self.launcher):
            if pid in self.seen:
                continue
            local = read_environ_value(pid, b"LOCAL_RANK")
            if not carries(read_tags(pid), self.match) or not (local or "").isdigit():
                continue  # not (yet) a rank: a worker between its launcher's fork and its exec has no LOCAL_RANK
            self.seen.add(pid)
            self.seen_ranks.add(int(local))
            rank = read_environ_value(pid, b"RANK")
            if (rank or "").isdigit():
                self.local_of[int(rank)] = int(local)
            try:
                self.watching[os.pidfd_open(pid)] = int(local)
            except OSError:
                pass  # gone already: its end is not known to the millisecond

    def all_ended(self):
        """Whether every rank of this node has ended, or ended its script (their launcher, and the
        interpreters' teardown, may still run)."""
        return bool(self.count) and len(set(self.ends) | self.ended_scripts) >= self.count

    def clean(self):
        """The local ranks whose scripts have ended cleanly (their end markers name global ranks)."""
        return {self.local_of[rank] for rank in self.scripts() if rank in self.local_of}

    def died(self):
        """The local ranks that have ended without their scripts' clean end (a signal, os._exit)."""
        clean = self.clean()
        return [rank for rank in list(self.ends) if rank not in clean]

    def stop(self):
        """Once the launch's processes are gone: {local rank: when it ended}."""
        if self.thread is not None:
            os.write(self.wake_w, b"x")
            self.thread.join(2.0)
            os.close(self.wake_w)
            self.thread = None
        return dict(self.ends)

