"""The controller <-> node agent protocol: every frame, both directions, every agent mode.

Stdlib only (Python 3.8+): the controller imports this module, and ships it to every node as the
first module of the node package (see ``protocol.bootstrap_args``), so both ends share one definition.

A frame is one line, ``KIND JSON`` (``KIND`` alone for a frame without fields), where KIND is the
frame's class name and JSON its fields. A frame with a body (``Output``, ``File``) announces its
``size`` in the header and is followed by exactly that many raw bytes, so nothing a job prints
(newlines, binary, text that looks like a frame) can ever be read as a frame. An unknown kind, a
frame sent the wrong way, bad JSON or wrong fields are a ``ProtocolError``, never data.

A conversation: the controller writes the agent source (the bootstrap reads it by length), then
one spec frame that picks the agent's mode, then that mode's commands; EOF on the agent's stdin
means the controller is gone, and the agent stops whatever it started.

  mode    controller -> agent                       agent -> controller
  run     RunSpec; Heartbeat, Probe, Go, Dump,      Ready or Failed; Heartbeat, Probed, Started,
          Signal, Stop, Kill                        Output, Bars, GpuUsage, RanksUp, Arrivals, Dumped,
                                                    Collectives, Stopping, Exited
  detect  DetectSpec                                Detected
  sweep   SweepSpec                                 Listed, Swept
  sync    SyncSpec; AskShared, File (+ bytes)...,   Needs or Failed; Shared; Copied or Failed
          EndOfFiles
  follow  FollowSpec                                a detached job's journal: Started, Output,
                                                    Stopping, Exited (as run sent them), Stamp;
                                                    Replayed, then live Bars; Heartbeat;
                                                    JournalEnd or Failed
  list    ListSpec                                  Jobs
  fetch   FetchSpec; Want                           Listing or Failed; Chunk (+ bytes)..., Sent

A detached job (RunSpec.detach) also writes every frame after Go to a journal on its node, and
its agents talk to each other, not to the controller, once it is gone: each node's agent joins
the supervisor in the master node's agent (TCP on the master address, Go.supervisor) with PEER
frames: Challenge -> Join (an HMAC of the challenge under the job's token), then NodeState and
Progress from the node, DumpStacks, Halt and Heartbeat from the supervisor. With restarts left,
a node that reported its end waits for the supervisor's word: Restart (the next attempt, its
master port; a journal of its own on each node, journal.<N>) or RunOver.
"""

from __future__ import annotations

import json

MAX_HEADER = 64 << 20  # a header line longer than this is garbage, not a frame (specs list files)


class ProtocolError(Exception):
    """The other end sent something that is not a frame of this protocol."""


TO_AGENT = {}  # frames the controller sends, by kind: {bytes: type}
TO_CONTROLLER = {}  # frames the agent sends, by kind
PEER = {}  # frames between a detached job's agents (both ways)


def _frame(*directions):
    """A frame class from its annotated fields: keyword or positional, defaults from the class
    body, immutable, equal by value. Not ``dataclasses``: every node agent builds these classes
    at start-up, and dataclasses (with its imports) is a third of the agent's start on a node,
    paid once per node per launch."""
    def register(cls):
        names = tuple(getattr(cls, "__annotations__", {}))  # Frame itself has none to inherit
        cls.NAMES = names
        cls.REQUIRED = tuple(n for n in names if n not in cls.__dict__)
        cls.KIND = cls.__name__.encode()
        cls.FIELDS = tuple(n for n in names if not (cls.BODY == "data" and n == "data"))
        for registry in directions:
            registry[cls.KIND] = cls
        return cls
    return register


value = _frame  # a value class with the frames' fields and checks, in no direction (node/protocol/events.py)


class Frame:
    KIND = b""
    NAMES = ()  # every field, in order
    REQUIRED = ()  # the fields without a default
    FIELDS = ()  # header fields, in order
    BODY = None  # "data": the ``size`` bytes after the header are the field ``data``; "stream": the
    # ``size`` bytes after the header are left in the stream for the reader (a file, streamed to disk)

    def __init__(self, *args, **kwargs):
        name = type(self).__name__
        if len(args) > len(self.NAMES):
            raise TypeError("%s takes %d fields, not %d" % (name, len(self.NAMES), len(args)))
        for field, value in zip(self.NAMES, args):
            if field in kwargs:
                raise TypeError("%s got field %r twice" % (name, field))
            kwargs[field] = value
        wrong = []
        unknown = [k for k in kwargs if k not in self.NAMES]
        if unknown:
            wrong.append("unknown field(s) " + ", ".join(unknown))
        missing = [k for k in self.REQUIRED if k not in kwargs]
        if missing:
            wrong.append("missing field(s) " + ", ".join(missing))
        if wrong:
            raise TypeError("%s: %s" % (name, "; ".join(wrong)))
        self.__dict__.update(kwargs)

    def __setattr__(self, name, value):
        raise AttributeError("a %s frame cannot be changed" % type(self).__name__)

    __delattr__ = __setattr__

    def _values(self):
        return tuple(getattr(self, n) for n in self.NAMES)

    def __eq__(self, other):
        return type(other) is type(self) and other._values() == self._values()

    def __hash__(self):
        return hash((type(self), self._values()))

    def __repr__(self):  # the header fields: never a body's bytes
        return "%s(%s)" % (type(self).__name__, ", ".join("%s=%r" % item for item in self.fields().items()))

    def encode(self) -> bytes:
        if self.BODY == "data":
            return self.header(len(self.data)) + self.data
        return self.header()

    def header(self, size=None) -> bytes:
        """The frame's header line; ``size``: the length of the body that follows it (a writer
        that sends the body from a buffer of its own: fetch mode)."""
        values = self.fields()
        if size is not None:
            values["size"] = size
        if not values:
            return self.KIND + b"\n"
        return self.KIND + b" " + json.dumps(values).encode() + b"\n"

    def fields(self) -> dict:
        return {name: getattr(self, name) for name in self.FIELDS}


# --- specs: the first frame after the agent's source picks the mode -------------------------------

@_frame(TO_AGENT)
class RunSpec(Frame):
    """Preflight this node, wait for Go, run the launcher, relay its output, stop it on request."""

    job: str
    node: int
    cluster: str
    run: str  # this launch's tag: the agent's own cleanup matches it, so it never touches another launch
    workdir: str | None
    script: str
    env: dict[str, str]
    pick_port: bool  # the master node: hold a free port and report it
    check_port: int | None  # the master node: hold this port (and fail if taken)
    orphan_timeout: float
    stop_grace: float
    heartbeat: float
    stack_dumps: bool
    stop_signal: str = "SIGTERM"  # a stop's first signal to the launcher (and from it to every rank)
    flight_recorder: bool = False  # every rank records its collectives; the agent reads them (node/watch/flight.py)
    needs_torch: bool = True  # torchrun and legacy; `launcher: none` runs any program, and skips the probe
    detach: bool = False  # the job outlives the controller: journal, record, and the supervisor (see above)
    token: str | None = None  # detach: the secret the job's agents prove to each other
    nodes: int = 1  # detach: how many nodes the supervisor waits for
    label: str = ""  # detach: the node as the cluster file names it (the record's)
    ranks: list[int] | None = None  # detach: [first global rank, rank count] (the record's)
    hang_timeout: float | None = None  # detach: the supervisor's hang watch (see node/supervise/detached.py)
    startup_timeout: float | None = None  # detach: the same watch's start-up limit (policy.startup_limit)
    retention: float = 604800.0  # detach: seconds its record and journal stay after its end
    nproc: int | None = None  # processes on this node: the GPUs checked for others' processes
    hooks: dict | None = None  # file name -> text: written to the node's state dir, put on the job's PYTHONPATH
    attempt: int = 0  # a restarted job's attempt (DDP_UP_ATTEMPT); its state directory is its own
    restarts: int = 0  # detach: attempts after the first that the supervisor may start (see node/supervise/detached.py)
    restart_delay: float = 10.0  # detach: seconds before attempt 1; attempt N waits N times that
    recoveries: int = 0  # detach: attempts after a stop from outside the job (policy.next_attempt's budgets)
    no_restart_on_exit: list | None = None  # detach: exit codes that end the job whatever restarts are left
    master_addr: str | None = None  # detach, the master node: where the peers reach its supervisor (it listens there)
    # detach: the job's secret values (env:, env_file:, forward_env:), masked in its journal and records here,
    # so an attach from a shell or cluster file that does not know them shows none of them
    secrets: list | None = None
    notify: list | None = None  # detach: [[kind, value, events or None]]: webhook and command targets (node/supervise/notify.py)
    commit: str | None = None  # detach: the commit the job ran from, for its record (ddp-ls)
    # detach, `min_nodes:` (an elastic job): each node's rank count, by node index (a later attempt's
    # layout, supervise/layout.py); the fewest nodes an attempt runs on; how long a node left out
    # answers before the job stops to take it back (None: never, only at a restart that happens anyway)
    sizes: list | None = None
    min_nodes: int | None = None
    rejoin_after: float | None = None
    evict_after: float | None = None  # detach, elastic: a node that straggles this long is set aside (members.py)
    warm: bool = False  # fork every rank from a warm interpreter (node/launchers/warm.py; in a container, node/launchers/boxwarm.py)
    warm_gpus_only: bool = False  # warm only on a node with NVIDIA GPUs (ddp-check --gpus: elsewhere no torch)
    preload: list | None = None  # warm: modules it imports besides torch
    keep: str | None = None  # warm: the kept interpreter its ranks are forked from (node/attempt/keep.py), by its name
    container: dict | None = None  # the image the launcher runs in: runtime, image, pull, mounts, options, python (node/launchers/container.py)
    box_code: dict | None = None  # in a container, {module: source} its first process runs (container.BOX_MAIN)


@_frame(TO_AGENT)
class DetectSpec(Frame):
    """Report what planning needs to know (the GPU count the job would see)."""

    env: dict[str, str]


@_frame(TO_AGENT)
class KeepSpec(Frame):
    """Keep a warm interpreter ready for the launches of one Python session (node/attempt/keep.py), until
    the controller goes (end of stdin) or is silent for ``orphan_timeout`` seconds."""

    name: str  # the kept interpreter's name: the launches' RunSpec.keep
    env: dict[str, str]
    preload: list | None
    nproc: int | None
    orphan_timeout: float
    container: dict | None = None  # the job's image (RunSpec.container): kept in a container there (node/launchers/keptbox.py)
    box_code: dict | None = None  # then the code its first process runs (boxkeep.py), as RunSpec.box_code
    workdir: str | None = None  # the job's workdir (RunSpec.workdir): the interpreter's, or the container's, bound into it


@_frame(TO_AGENT)
class SweepSpec(Frame):
    """Find the processes carrying these tags and stop them (ddp-kill, and lost nodes)."""

    match: dict[str, str]
    grace: float
    dry_run: bool
    purge: bool = False  # also remove finished detached jobs' records and journals (else kept a while)
    signal: str | None = None  # instead: deliver this signal (SIGUSR1...) to every rank found; stop nothing
    runtimes: list | None = None  # the container runtimes (docker, podman) whose containers of the match go too


@_frame(TO_AGENT)
class SyncSpec(Frame):
    """Say which of ``entries`` ([path, size, mtime_ns, mode, link]) differ under ``dest``; take them."""

    dest: str
    entries: list[list]
    idle_timeout: float


@_frame(TO_AGENT)
class FollowSpec(Frame):
    """Send a detached job's journal on this node from its start; with ``follow``, go on until the
    job there has ended (else stop at its current end)."""

    job: str
    node: int
    follow: bool
    heartbeat: float = 5.0
    tail: int | None = None  # only the last this many lines of each rank's (and stream's) backlog
    attempt: int = 0  # which attempt's journal (a detached job that restarted has one per attempt)


@_frame(TO_AGENT)
class FetchSpec(Frame):
    """List ``path`` (under ``root``, the node's workdir, unless absolute); send what is wanted."""

    root: str
    path: str


@_frame(TO_AGENT)
class Want(Frame):
    """Fetch mode: the indices of the Listing's files to send (none: the controller has them all)."""

    indices: list


@_frame(TO_AGENT)
class ListSpec(Frame):
    """Report the detached jobs recorded on this node (running and finished)."""


SPECS = (RunSpec, DetectSpec, SweepSpec, SyncSpec, FollowSpec, ListSpec, FetchSpec, KeepSpec)


# --- run mode -----------------------------------------------------------------------------------

@_frame(TO_AGENT, TO_CONTROLLER)
class Heartbeat(Frame):
    """Both ways, every few seconds: silence past orphan_timeout means the other end is gone."""


@_frame(TO_AGENT)
class Probe(Frame):
    """Open a TCP connection to the master's address and port, and say whether it worked."""

    addr: str
    port: int
    timeout: float


@_frame(TO_AGENT)
class Go(Frame):
    argv: list[str]
    supervisor: list | None = None  # detach: [address, port] of the master node's supervisor
    env: dict | None = None  # set by ddp-up at go (the interface that reaches the master), over the spec's
    # detach, `evict_after:`, the master node's: what nvidia-smi said of each node's GPUs at the
    # preflight ({node index as text: words}), for the words of a node set aside
    gpus_said: dict | None = None


@_frame(TO_AGENT)
class Dump(Frame):
    """Have every worker print its Python stack (the job looks hung)."""


@_frame(TO_AGENT)
class Signal(Frame):
    """Pass this signal (SIGUSR1, SIGUSR2) on to every rank here, straight: it is not a stop."""

    name: str


@_frame(TO_AGENT)
class Stop(Frame):
    """SIGTERM the launcher, SIGKILL what is left after stop_grace. ``peer_lost``: the stop is for
    a node lost: a rank stuck in a collective, which cannot complete without it, is not waited for."""

    peer_lost: bool = False


@_frame(TO_AGENT)
class Kill(Frame):
    """SIGKILL every process of the job on this node, now."""


@_frame(TO_CONTROLLER)
class Ready(Frame):
    """Preflight passed; the node waits for Go."""

    hostname: str
    python: str
    torch: str | None  # None: not probed (`launcher: none`)
    cuda: str | None
    nccl: str | None
    gpus: int
    time: float  # the node's wall clock (skew check)
    disk_free: int
    port: int | None = None  # the master node's free port, when it picked one
    supervisor_port: int | None = None  # detach, the master node: where its supervisor listens
    busy_gpus: list | None = None  # others' processes on the job's GPUs: [{"gpu", "pid", "user", "cmd", "mib"}]
    gpu_health: list | None = None  # what nvidia-smi says of the job's GPUs, one dict each (gpuhealth.parse_health)


@_frame(TO_CONTROLLER)
class Failed(Frame):
    """This node cannot do what its spec asked (preflight, sync); nothing was started."""

    what: str
    fix: str = ""


@_frame(TO_CONTROLLER)
class Probed(Frame):
    """The probe's answer, and the node's interfaces as seen from the master's address (see
    facts.network_facts): the interface and source address of the route the kernel takes to
    it, GLOO_/NCCL_SOCKET_IFNAME as the job's environment sets them, [var, value, why] for each of
    those that cannot reach the master, and what the node's hostname resolves to (and where)."""

    ok: bool
    error: str | None = None
    iface: str | None = None
    source: str | None = None
    explicit: dict | None = None
    bad: list | None = None
    hostname: str | None = None
    resolves: str | None = None
    resolves_iface: str | None = None


@_frame(TO_CONTROLLER)
class Started(Frame):
    """The launcher runs."""


@_frame(TO_CONTROLLER)
class Output(Frame):
    """What one process wrote to one stream: a worker (``rank``, its local rank) or the launcher
    itself (``rank`` None). The bytes follow the header: whole lines, except the last piece when
    it does not end in a newline (a line longer than the agent sends at once, or the unterminated
    end of the stream); the next Output of the same stream and rank goes on from there."""

    BODY = "data"
    stream: str  # "out" | "err"
    rank: int | None
    data: bytes

    def split(self) -> tuple:
        """(the text of each whole line, the text of an unfinished last piece or ""). Bytes that
        are not UTF-8 become surrogates, so no byte is lost."""
        parts = self.data.decode("utf-8", "surrogateescape").split("\n")
        return parts, parts.pop()

    def pieces(self) -> list[tuple]:
        """[(text, more)]: each piece's text, and whether it goes on in the next Output."""
        lines, tail = self.split()
        return [(text, False) for text in lines] + ([(tail, True)] if tail else [])

    def lines(self) -> list[str]:
        """The text of each piece (tests and tools; the session keeps ``pieces``)."""
        return [text for text, _ in self.pieces()]


@_frame(TO_CONTROLLER)
class Bars(Frame):
    """The rows workers are still drawing (progress bars: node/watch/screen.py), for the ones that
    changed since the last Bars: [[stream, local rank, [row text, ...]]], top row first; no rows:
    nothing is drawn there now. At most BARS_EVERY apart; a detached job's journal keeps one every
    Writer.JOURNAL_BARS_EVERY and every clearing (its final state arrives as an Output line)."""

    bars: list


@_frame(TO_CONTROLLER)
class Dumped(Frame):
    """These ranks were signalled to print their stacks (which follow as their stderr Output)."""

    ranks: list[int]


@_frame(TO_CONTROLLER)
class Stopping(Frame):
    reason: str
    # who stops it: None, ddp-up (its Stop, or the end it answers to gone); "ddp-kill" (a signal
    # to the agent with ddp-kill's note: the run is over); "signal" (anyone else's signal to the
    # agent: Slurm, a shutdown; a stop from outside the job, which the run may recover from)
    by: str | None = None
    at: float | None = None  # when the agent began to stop (its wall clock): before any rank it stops fails


@_frame(TO_CONTROLLER)
class Exited(Frame):
    """The job on this node is over and every process of it is gone."""

    code: int | None  # the launcher's exit code; None if it never started or could not be reaped
    signal: str | None  # the signal that ended the launcher, if one did
    stopped: bool  # ended because it was asked to (Stop, Kill, controller gone, a signal to the agent)
    reason: str | None
    gpu_left: list | None = None  # this job's processes still holding GPU memory after its end (busy_gpus' form)
    # the ranks that failed here by themselves (before any stop), earliest first: failures.rank_failures' form
    failures: list | None = None
    ends: dict | None = None  # {local rank: when it ended (wall clock)}, before any stop, where the node saw it
    overran: int | None = None  # a graceful stop: how many of the job's processes outlived stop_grace (SIGKILLed)


@_frame(TO_CONTROLLER)
class Result(Frame):
    """A function's launch (the Python API): what one rank's function returned, as the rank pickled
    it (``data``), or why it cannot come back (``problem``). Sent before the node's Exited."""

    BODY = "data"
    rank: int  # global rank
    problem: str | None
    data: bytes


@_frame(TO_CONTROLLER)
class GpuUsage(Frame):
    """A sample of the node's GPUs for the dashboard: [[index, util %, used MiB, total MiB]]."""

    gpus: list


@_frame(TO_CONTROLLER)
class Collectives(Frame):
    """Each rank's last collectives, as torch's Flight Recorder keeps them (node/watch/flight.py):
    {rank: [[group name, group description, sequence number, op, done, input sizes, input dtypes,
    output sizes, output dtypes, called (ns, wall clock)], ...]}, oldest first. After a stack
    dump and at an attempt's end. The job's own bytes: the controller checks every field."""

    ranks: dict


@_frame(TO_CONTROLLER)
class RanksUp(Frame):
    """These ranks' process groups are up (global ranks, as the Flight Recorder's hook saw them):
    the controller starts their hang clocks (hang.py). At most once per rank and attempt."""

    ranks: list


@_frame(TO_CONTROLLER)
class RanksEnded(Frame):
    """Every rank of this node has ended; its launcher is finishing (torchrun's exit barrier
    waits for the other nodes' agents). Such a node is no hang (hang.py). Once per attempt."""


@_frame(TO_CONTROLLER, PEER)
class Arrivals(Frame):
    """While the job runs: for collectives every rank of the node called, when the node's last
    rank called it (wall clock) and which rank that was: [[group name, seq, seconds, rank]].
    Not journaled (a detached job's straggler view is live only)."""

    times: list


# --- one-shot modes -------------------------------------------------------------------------------

@_frame(TO_CONTROLLER)
class Detected(Frame):
    gpus: int


@_frame(TO_CONTROLLER)
class Kept(Frame):
    """Keep mode: the interpreter answered: ready (its imports done, in ``seconds``), or why not."""

    ready: bool
    why: str | None = None
    seconds: float | None = None


@_frame(TO_CONTROLLER)
class Listed(Frame):
    """The tagged processes found (before anything is stopped): [{"pid", "tags", "cmd"}]."""

    found: list[dict]


@_frame(TO_CONTROLLER)
class Swept(Frame):
    killed: list[int]  # needed SIGKILL after the grace period
    left: list[int]  # still alive at the end (should be empty)
    removed: list | None = None  # the state it removed ("JOB nodeN"; a dry run: what it would remove)
    signalled: list | None = None  # SweepSpec.signal: the ranks (pids) it reached
    containers: list | None = None  # the containers it removed (a dry run: would remove), by name


@_frame(TO_CONTROLLER)
class Needs(Frame):
    """The indices of the sync entries that differ on this node, and the marker it keeps there."""

    dest: str
    need: list[int]
    marker: str


@_frame(TO_AGENT)
class AskShared(Frame):
    """Which of these other nodes' markers does this workdir hold too (a shared filesystem)?"""

    markers: list[str]


@_frame(TO_CONTROLLER)
class Shared(Frame):
    sees: list[str]


@_frame(TO_AGENT)
class File(Frame):
    """One needed entry's contents: ``size`` raw bytes follow, which the agent streams to disk."""

    BODY = "stream"
    index: int
    size: int
    mtime_ns: int


@_frame(TO_AGENT)
class EndOfFiles(Frame):
    """Every needed file was sent: place the links and report."""


@_frame(TO_CONTROLLER)
class Copied(Frame):
    files: int
    bytes: int
    links: int


@_frame(TO_CONTROLLER)
class JournalEnd(Frame):
    """Follow mode: the journal was sent to its end (``running``: the job there goes on)."""

    running: bool
    later: bool = False  # a later attempt follows this one here (or the job waits to start it)
    absent: bool = False  # this attempt never started here: the job ended while it waited to restart
    # the job here as its record says: when it started and ended (wall clock), its master (addr:port)
    started: float | None = None
    ended: float | None = None
    master: str | None = None
    next: str | None = None  # the master node's: what its supervisor decided after this attempt, and why
    nodes: list | None = None  # the master node's, for an elastic job: the nodes of the attempt that follows,
    lost: int | None = None  # the node its supervisor found lost, this attempt's root cause,
    lost_why: str | None = None  # and why it found it lost ("no word from its agent for 31 s"),
    reshaped: str | None = None  # and whether it stopped the attempt to change its nodes: "grow", "aside"
    over: bool = False  # the master node's: its supervisor decided that no attempt follows this one


@_frame(TO_CONTROLLER)
class Listing(Frame):
    """Fetch mode: the absolute path listed, and every regular file and link under it:
    [[path, size, mtime_ns, mode, link]] (relative, "/"-separated; "" for a file named alone);
    ``left_out``: what was not listed, each with why (another kind of file, unreadable)."""

    base: str
    entries: list
    left_out: list | None = None


@_frame(TO_CONTROLLER)
class Chunk(Frame):
    """Fetch mode: the next bytes of a wanted file (``end``: its last Chunk, maybe empty)."""

    BODY = "data"
    index: int
    end: bool
    data: bytes


@_frame(TO_CONTROLLER)
class Sent(Frame):
    """Fetch mode: every wanted file was sent; ``changed``: those that changed (or could not be
    read) while they were sent."""

    files: int
    bytes: int
    changed: list | None = None


@_frame(TO_CONTROLLER)
class Stamp(Frame):
    """In a detached job's journal: the node's wall clock when the frames after it were written
    (at most Writer.STAMP_EVERY apart, never going back), so that a reader can put the nodes'
    lines in time order."""

    at: float


@_frame(TO_CONTROLLER)
class Replayed(Frame):
    """Follow mode: every frame the journal held was sent; what follows is live. With what the
    node's record says of the job so far (its start, its master): an attach's header shows them."""

    started: float | None = None
    master: str | None = None


@_frame(TO_CONTROLLER)
class Jobs(Frame):
    """List mode: one record per detached job on this node (see agent.write_record);
    ``skipped``: each record file that was not listed, with why (damaged, planted, too large)."""

    jobs: list[dict]
    skipped: list | None = None


# --- between a detached job's agents --------------------------------------------------------------

@_frame(PEER)
class Challenge(Frame):
    nonce: str


@_frame(PEER)
class Join(Frame):
    node: int
    proof: str  # hex HMAC-SHA256 of the nonce under the job's token


@_frame(PEER)
class NodeState(Frame):
    node: int
    state: str  # "running" | "done" | "failed" | "stopped"
    code: int | None = None
    reason: str | None = None
    attempt: int = 0  # the attempt this is the state of (a stale one is not taken for the current)
    final: bool = False  # stopped for good (its agent got a signal: ddp-kill, a shutdown): no restart
    # failed: its earliest rank failure (failures.rank_failures' form, the global rank): its own time
    # (the node's wall clock) and exception, for the root cause; None: the supervisor's clock
    failure: dict | None = None


@_frame(PEER)
class Progress(Frame):
    """A node's heartbeat to the supervisor: seconds since any of its ranks printed a line, and
    its ranks that have not begun (no line, no bar, process group not up: start-up)."""

    node: int
    quiet: float
    waiting: list | None = None  # global ranks
    ended: bool = False  # every rank here has ended: its launcher is finishing, which is no hang


@_frame(PEER)
class DumpStacks(Frame):
    """The job looks hung: have every rank here print its Python stack (as Dump does)."""


@_frame(PEER)
class Halt(Frame):
    """Stop the job on this node: another node failed, or the supervisor lost one (``peer_lost``:
    a rank stuck in a collective, which cannot complete without it, is not waited for: see Stop)."""

    reason: str
    peer_lost: bool = False


@_frame(PEER)
class Restart(Frame):
    """Start attempt ``attempt`` here, its master on ``port``: the attempt before ended on every
    node, and the job has restarts left (detach, ``restarts:``)."""

    attempt: int
    port: int
    nodes: list | None = None  # an elastic job: the nodes it runs on, by index (None: every node)


@_frame(PEER)
class RunOver(Frame):
    """No further attempt: record this node's end and exit."""

    reason: str


PEER[Heartbeat.KIND] = Heartbeat


# --- decoding -----------------------------------------------------------------------------------

def parse_header(line: bytes, registry: dict[bytes, type]):
    """One header line (without its newline) -> (frame class, fields); ProtocolError if it is not
    a frame that may travel this way."""
    kind, _, payload = line.partition(b" ")
    cls = registry.get(kind)
    if cls is None:
        raise ProtocolError("unexpected frame %r" % _shorten(line))
    if not payload:
        return cls, {}
    try:
        values = json.loads(payload)
    except ValueError:
        raise ProtocolError("malformed %s frame (not JSON)" % cls.__name__) from None
    if not isinstance(values, dict):
        raise ProtocolError("malformed %s frame (not an object)" % cls.__name__)
    return cls, values


def build(cls, values: dict, body: bytes = b""):
    """The frame from its header fields (and body); ProtocolError if the fields do not fit."""
    if cls.BODY is not None:
        size = values.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ProtocolError("malformed %s frame (size %r)" % (cls.__name__, size))
        if cls.BODY == "data":
            values = dict(values, data=body)
            del values["size"]
    try:
        return cls(**values)
    except TypeError as e:
        raise ProtocolError("malformed %s frame (%s)" % (cls.__name__, e)) from None


def body_size(cls, values: dict) -> int:
    """Bytes that follow this header and belong to the frame (0 if the reader takes them itself)."""
    if cls.BODY != "data":
        return 0
    size = values.get("size")
    return size if isinstance(size, int) and size > 0 else 0


class Decoder:
    """A byte stream -> frames, fed in chunks of any size (controller side). A body's bytes are
    kept as the views of the chunks they came in, joined once when whole: one copy of a file's
    bytes on their way through (ddp-fetch moves gigabytes this way), not one per step."""

    def __init__(self, registry: dict[bytes, type] = TO_CONTROLLER):
        self.registry = registry
        self.buf = bytearray()  # the start of a header line, waiting for its end
        self.pending = None  # (cls, values): a header waiting for its body
        self.parts: list = []  # the body so far: views of the chunks fed
        self.need = 0  # bytes of the body still to come

    def feed(self, data: bytes) -> list:
        data = data if isinstance(data, bytes) else bytes(data)  # the views below outlive the call
        frames = []
        pos = 0
        try:
            while pos < len(data):
                if self.pending is not None:
                    pos = self._body(data, pos, frames)
                    continue
                end = data.find(b"\n", pos)
                if end < 0:
                    self.buf += data[pos:]
                    if len(self.buf) > MAX_HEADER:
                        raise ProtocolError("a header line of more than %d bytes" % MAX_HEADER)
                    break
                line = bytes(self.buf) + data[pos:end] if self.buf else data[pos:end]
                self.buf.clear()
                pos = end + 1
                self._header(line, frames)
        except ProtocolError as e:
            e.frames = frames  # what was whole before the damage (a journal's undamaged part)
            raise
        return frames

    def _header(self, line: bytes, frames: list) -> None:
        cls, values = parse_header(line, self.registry)
        size = body_size(cls, values)
        if size:
            self.pending, self.parts, self.need = (cls, values), [], size
        else:
            frames.append(build(cls, values))

    def _body(self, data: bytes, pos: int, frames: list) -> int:
        """Take what ``data`` holds of the pending body from ``pos``; the position after it."""
        take = min(len(data) - pos, self.need)
        self.parts.append(memoryview(data)[pos:pos + take])
        self.need -= take
        if not self.need:
            cls, values = self.pending
            body, self.pending, self.parts = b"".join(self.parts), None, []
            frames.append(build(cls, values, body))
        return pos + take

    def at_rest(self) -> bool:
        """True between frames (a stream that ends otherwise was cut mid-frame)."""
        return not self.buf and self.pending is None


def read_frame(stream, registry: dict[bytes, type] = TO_AGENT):
    """The next frame from a blocking binary stream (agent side); None at EOF. A ``File`` frame's
    bytes are left in the stream for the caller."""
    line = stream.readline()
    if not line:
        return None
    if not line.endswith(b"\n"):
        raise ProtocolError("the stream ended inside a frame")
    cls, values = parse_header(line[:-1], registry)
    size = body_size(cls, values)
    body = stream.read(size) if size else b""
    if len(body) < size:
        raise ProtocolError("the stream ended inside a %s frame" % cls.__name__)
    return build(cls, values, body)


def _shorten(data: bytes, limit: int = 40) -> str:
    text = data[:limit].decode("utf-8", "replace")
    return text + ("..." if len(data) > limit else "")
