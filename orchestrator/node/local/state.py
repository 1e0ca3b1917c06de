"""The agent's state on a node: private directories, records and journals, never through a link.

  $TMPDIR/ddp-up-$UID/               this user's, 0700, checked (never created through a link)
    <job>/                           0700
      node<N>/                       created exclusively: a job id already in use here is refused
        hooks/                       files the job runs (stack-dump hook, launcher), 0600
        logs/                        torchrun's per-worker log files, relayed by the Tailer
        journal                      a detached job: every frame after Go, as the controller was sent it,
                                     with the time (Stamp) every STAMP_EVERY seconds
        bars                         a detached job: its ranks' bars now (a live attach shows them)
        record.json                  a detached job: what ddp-ls shows (script, ranks, state, times, code)
        outcome.json                 a detached job's master node: every node's end, the root cause
        attempts.json                a detached job's master node: the attempts so far, and what followed each

A later attempt of a restarted job has what is its own beside the first's (see per_attempt).
"""

import errno
import json
import os
import re
import shutil
import stat
import tempfile
import threading
import time

from ..protocol import wire
from .procs import TAG_ATTEMPT, TAG_JOB, TAG_NODE, read_tags

# A job id names directories here and on the controller: a plain name, never a path.
JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
JOURNAL = "journal"
BARS = "bars"
RECORD = "record.json"
OUTCOME = "outcome.json"
ATTEMPTS = "attempts.json"  # the master node's: every attempt so far that another followed, with why
ENDED = ("done", "failed", "stopped", "lost")
LIVE = ("running", "restarting", "away")  # while its agent runs: "away", an elastic job's node left out
RETENTION = 7 * 86400.0  # a finished detached job's record and journal are kept this long


def state_root():
    return os.path.join(tempfile.gettempdir(), "ddp-up-%d" % os.getuid())


def private_dir(path, create=True):
    """None if ``path`` is (now) a real directory of this user's that no one else can enter;
    else what is wrong with it. Never follows a link: a directory that another local user made,
    replaced or pointed elsewhere first is refused, not used. One of this user's that others may
    only read (earlier versions made it 0755) is tightened to 0700; one others could write into
    may hold anything, and is refused."""
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as e:
            return "cannot be created (%s)" % (e.strerror or e)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            return "is a symbolic link or not a directory"
        return "cannot be opened (%s)" % (e.strerror or e)
    try:
        st = os.fstat(fd)
        mode = stat.S_IMODE(st.st_mode)
        if st.st_uid != os.getuid():
            return "belongs to uid %d, not to this user (uid %d)" % (st.st_uid, os.getuid())
        if mode & 0o022:
            return "is writable by other users (mode %03o)" % mode
        if mode & 0o077:
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)
    return None


def unsafe_state(path, why):
    return wire.Failed("ddp-up's state directory %s %s; refusing to use it" % (path, why),
                       "if you made it, remove it (rm -rf %s); if another user did, ask an admin to, or give the "
                       "agent a private TMPDIR with `setup: export TMPDIR=$HOME/.cache/ddp-up-tmp`" % path)


STATE_MOST = 1 << 20  # bytes of a record, outcome, attempts or bars file: a larger one is damaged, not read


def open_regular(path):
    """A file in a directory others or the job can write (the state root, a job's hooks and
    logs), opened to read: never through a link, never blocking (a FIFO planted under a
    record's or a log's name would hold the reader forever), and only if it is a regular file.
    The descriptor, or None. Every file the agent reads there is opened here."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def read_regular(path, most=STATE_MOST):
    """(the bytes of the regular file at ``path``, None), or (None, why not): missing, not a
    regular file, or larger than ``most`` bytes (then it is not read whole: memory stays bounded)."""
    fd = open_regular(path)
    if fd is None:
        return None, "missing" if not os.path.lexists(path) else "not a regular file"
    with os.fdopen(fd, "rb") as f:
        data = f.read(most + 1)
    if len(data) > most:
        return None, "larger than %d MiB" % (most >> 20)
    return data, None


def per_attempt(name, attempt):
    """What a later attempt of a restarted job has of its own is named ``<name>.<attempt>``:
    ddp-up's attempts get node directories (``node<N>.<attempt>``: the one before may still be
    ending on this host), a detached job's a journal and a torchrun log directory each."""
    return name if not attempt else "%s.%d" % (name, attempt)


def node_dir_name(node, attempt=0):
    return per_attempt("node%d" % node, attempt)


def parse_node_dir(entry):
    """The tags a node directory's processes carry ({TAG_NODE[, TAG_ATTEMPT]}), or None if the
    name is not one ddp-up gives."""
    found = re.fullmatch(r"node([0-9]+)(?:\.([0-9]+))?", entry)
    if not found:
        return None
    tags = {TAG_NODE: found.group(1)}
    if found.group(2):
        tags[TAG_ATTEMPT] = found.group(2)
    return tags


CLUSTER_FILE = "cluster"  # the cluster id of the job a node directory is of (ddp-kill CLUSTER touches only its own)


CLAIM_TRIES = 5  # times a node directory is claimed while another job's sweep removes its empty job directory


def claim_node_dir(job, node, attempt=0, cluster=None):
    """(the node's state directory, None), or (None, Failed): the job's id is in use here, or
    the state root is not private. ``cluster``: the job's cluster id, kept in it (CLUSTER_FILE).
    Another job's sweep here (remove_stale_state) removes an empty job directory: one made here a
    moment before its node directory may go in between, and is made again."""
    root = state_root()
    path = os.path.join(root, job, node_dir_name(node, attempt))
    for _ in range(CLAIM_TRIES):
        unsafe = next(((p, why) for p in (root, os.path.dirname(path)) for why in [private_dir(p)] if why), None)
        if unsafe is not None:
            if os.path.lexists(unsafe[0]):
                return None, unsafe_state(*unsafe)
            continue  # it went since it was made: made again
        try:
            os.mkdir(path, 0o700)
            break
        except FileExistsError:
            return None, job_in_use(job, "its state directory %s exists" % path)
        except FileNotFoundError:
            continue  # its job directory went since it was checked: made again
        except OSError as e:
            return None, unsafe_state(path, "cannot be created (%s)" % (e.strerror or e))
    else:
        return None, unsafe_state(os.path.dirname(path), "went each time it was made (another job's sweep)")
    if cluster:
        write_private(os.path.join(path, CLUSTER_FILE), cluster)
    return path, None


def cluster_of(node_dir):
    """The cluster id a node directory was claimed for, or None (an older one, or unreadable)."""
    data, _ = read_regular(os.path.join(node_dir, CLUSTER_FILE), most=64)
    return None if data is None else data.decode("ascii", "replace")


def job_in_use(job, why):
    return wire.Failed("job id %s is already in use on this node (%s)" % (job, why),
                       "pick another --job-id, or stop the other one first: ddp-kill CLUSTER.yaml --job %s" % job)


def write_private(path, text):
    """A new file of ours, 0600, never through a link or over an existing file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def kill_note(pid):
    """Where ddp-kill notes, just before it signals an agent, that the signal is its own: the agent
    then says its job was stopped by ddp-kill (the run is over), not from outside (Slurm's time
    limit, a shutdown: the run may recover). In the private state root only; None if it is not."""
    root = state_root()
    return None if private_dir(root, create=False) else os.path.join(root, "kill.%d" % pid)


def note_kill(pid):
    """ddp-kill's note for agent ``pid`` (see kill_note): its path, or None."""
    path = kill_note(pid)
    if path is None:
        return None
    try:
        write_private(path, "ddp-kill\n")
    except FileExistsError:
        pass  # a second ddp-kill's: the same note
    except OSError:
        return None
    return path


def killed_by_ddp_kill():
    """In an agent that got a stop signal: whether ddp-kill sent it (its note, taken)."""
    path = kill_note(os.getpid())
    if path is None:
        return False
    try:
        os.unlink(path)
    except OSError:
        return False
    return True


class Journal:
    """Appends encoded frames to the journal file (created here, 0600, never through a link),
    each run of them after a Stamp of the node's wall clock, and keeps the ranks' bars now in a
    file beside it (``bars``): the journal keeps them only every so often."""

    STAMP_EVERY = 0.2  # seconds: what ddp-logs can order the nodes' lines by
    BARS_EVERY = 1.0  # the bars file is written at most this often

    def __init__(self, path, bars_path=None):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        self.lock = threading.Lock()
        self.failed = False
        self.stamped = float("-inf")  # the last Stamp's time: stamps never go back (a clock stepped back)
        self.bars_path, self.bars, self.bars_written, self.bars_journaled = bars_path, {}, float("-inf"), 0

    def append(self, data, is_bars=False):
        """``data`` (one frame) after a Stamp where the last is STAMP_EVERY old; ``is_bars``: a
        Bars frame (counted: a bars file older than the journal's last is not shown)."""
        now = time.time()
        if now - self.stamped >= self.STAMP_EVERY:
            self.stamped = max(now, self.stamped)
            data = wire.Stamp(at=round(self.stamped, 3)).encode() + data
        self.bars_journaled += is_bars
        self.write(data)

    def write(self, data):
        if self.failed:
            return
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self.fd, view):]
        except OSError:
            self.failed = True  # a full disk: the job goes on; its journal is cut here

    def keep_bars(self, bars):
        """A Bars frame's rows merged into the bars now; the file rewritten if BARS_EVERY has passed
        (a clearing at once: a stale bar must not come back)."""
        for stream, rank, rows in bars:
            if rows:
                self.bars[(stream, rank)] = rows
            else:
                self.bars.pop((stream, rank), None)
        now = time.monotonic()
        cleared = not all(rows for _, _, rows in bars)
        if self.bars_path is None or self.failed or not (cleared or now - self.bars_written >= self.BARS_EVERY):
            return
        self.bars_written = now
        rows = [[stream, rank, kept] for (stream, rank), kept in self.bars.items()]
        write_record(os.path.dirname(self.bars_path), {"journaled": self.bars_journaled, "bars": rows},
                     os.path.basename(self.bars_path))

    def close(self):
        with self.lock:
            os.close(self.fd)
            self.failed = True  # nothing more goes here


def read_bars(path, journaled):
    """The bars file's rows, as a Bars frame, if it is no older than the journal's ``journaled``-th
    Bars (a reader saw that many): else None, as for a missing or damaged file."""
    try:
        data, _ = read_regular(path)
        kept = json.loads(data.decode("utf-8")) if data is not None else None
        if kept is None or kept["journaled"] < journaled:
            return None
        return wire.Bars(bars=[[str(s), None if r is None else int(r), [str(t) for t in rows]]
                               for s, r, rows in kept["bars"]])
    except (OSError, ValueError, TypeError, KeyError, RecursionError):
        return None


def write_record(where, record, name=RECORD):
    """``record`` as JSON, replacing the last one in one rename (readers never see half)."""
    tmp = os.path.join(where, ".%s.%d" % (name, os.getpid()))
    try:
        os.unlink(tmp)
    except OSError:
        pass
    try:
        write_private(tmp, json.dumps(record))
        os.replace(tmp, os.path.join(where, name))
    except OSError:
        remove_quietly(tmp)


NUMBER = (int, float)
NONE = type(None)
# What the agent writes, by file and field: (required fields, optional ones), each with its types.
# A file that says otherwise was damaged (or not written by an agent), and is read as no record:
# one such file must not crash a listing, or hide the node's other jobs.
SHAPES = {
    RECORD: ({"job": str, "node": int, "state": str, "pid": int, "started": NUMBER},
             {"label": str, "script": str, "ended": NUMBER + (NONE,), "code": (int, NONE), "reason": (str, NONE),
              "retention": NUMBER, "attempt": int, "ranks": (list, NONE), "master": (str, NONE)}),
    OUTCOME: ({"root_cause": (dict, NONE)},
              {"job": str, "attempt": int, "ended": NUMBER, "halted": (str, NONE), "nodes": dict, "attempts": list}),
    ATTEMPTS: ({"attempts": list}, {}),
}
ROOT_CAUSE = ({"state": str}, {"node": (int, NONE), "code": (int, NONE), "reason": (str, NONE), "at": NUMBER,
                               "rank": (int, NONE), "exception": (str, NONE)})


def well_formed(value, shape):
    """Whether ``value`` is a dict with every required field and each field of the types given
    (a bool is not taken for a number)."""
    required, optional = shape
    if not isinstance(value, dict) or any(k not in value for k in required):
        return False
    for key, types in list(required.items()) + list(optional.items()):
        if key in value and (not isinstance(value[key], types) or isinstance(value[key], bool)):
            return False
    return True


def read_record(where, name=RECORD):
    """A record (or the outcome) as the agent wrote it, or None: none there, or a damaged one."""
    return checked_record(where, name)[0]


def checked_record(where, name=RECORD):
    """(the record, None), or (None, why it is not one: missing, not a regular file, too large,
    not JSON, or not of the record's shape)."""
    data, why = read_regular(os.path.join(where, name))
    if data is None:
        return None, why
    try:
        record = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError):
        return None, "not JSON"
    if not well_formed(record, SHAPES[name]):
        return None, "not a record of this version's shape"
    if name == OUTCOME and record["root_cause"] is not None and not well_formed(record["root_cause"], ROOT_CAUSE):
        return None, "not a record of this version's shape"
    return record, None


def live_state(record):
    """The record's state, or "lost" for a job whose agent is gone without recording its end (a
    SIGKILL, a reboot): a pid that now belongs to another process does not carry the job's tag."""
    state = record.get("state")
    if state in LIVE:
        tags = read_tags(record.get("pid") or 0) or {}
        if tags.get(TAG_JOB) != record.get("job"):
            return "lost"
    return state


def live_record(record, where):
    """``record`` with "state" its live state. An agent records its end, then exits: a record read
    just before the end and a look at its pid just after would call a finished job lost, so where
    the agent is gone the record is read once more, and only one that still says it runs is lost."""
    if record.get("state") in LIVE and live_state(record) == "lost":
        again = read_record(where)
        if again is not None and again.get("job") == record.get("job"):
            record = again
    return dict(record, state=live_state(record))


def job_node_dir(job, node):
    """The node directory of ``job`` here, or None (not a job id, or not a private directory on
    a private state root: never one reached through a link)."""
    root = state_root()
    if not JOB_ID.fullmatch(job) or private_dir(root, create=False):
        return None
    path = os.path.join(root, job, "node%d" % node)
    return None if private_dir(os.path.join(root, job), create=False) or private_dir(path, create=False) else path


def remove_quietly(*paths):
    for path in paths:
        if path:
            try:
                os.unlink(path)
            except OSError:
                pass


def remove_node_dir(path, keep_logs):
    """A node directory at the job's end here: its hooks go; unless ``keep_logs`` (torchrun's log
    copy, for a controller that may have missed lines), all of it, and the job's directory once
    its last node here is done. None: no directory was claimed."""
    if path is None:
        return
    shutil.rmtree(os.path.join(path, "hooks"), ignore_errors=True)
    if keep_logs:
        return
    shutil.rmtree(path, ignore_errors=True)
    try:
        os.rmdir(os.path.dirname(path))
    except OSError:
        pass
