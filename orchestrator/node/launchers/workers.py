"""`launcher: none`: the agent starts the job's workers itself, with no launcher process between.

Each worker is ``python -u SCRIPT ARGS`` with the variables ``init_process_group("env://")``
reads, as torchrun sets them, and its output in torchrun's log layout (so the Tailer relays it).
"""

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

from ..local.procs import JOB_SIGNALS, TAGS, signal_tagged

# `launcher: none`: the first word of the Go argv that asks this agent to start the workers itself
# (``OWN_LAUNCHER --name=value... SCRIPT ARGS``), with no launcher process between them.
OWN_LAUNCHER = "ddp-up-launch"

LAUNCH_OPTIONS = ("nproc-per-node", "node-rank", "first-rank", "world-size", "master-addr", "master-port")
FAIL_GRACE = 5.0  # after one worker failed: SIGTERM to the others, this long, then SIGKILL


def parse_launch(argv):
    """``--name=value`` options (all of LAUNCH_OPTIONS), then SCRIPT and its arguments, untouched.
    The controller built them from the plan, in the same ddp-up that shipped this agent: a
    ValueError here is a bug, not a user's mistake."""
    opts, i = {}, 0
    while i < len(argv) and argv[i].startswith("--") and "=" in argv[i]:
        name, _, value = argv[i][2:].partition("=")
        if name not in LAUNCH_OPTIONS:
            raise ValueError("%s: unknown option --%s" % (OWN_LAUNCHER, name))
        opts[name] = value
        i += 1
    missing = [n for n in LAUNCH_OPTIONS if n not in opts]
    if missing or i >= len(argv):
        raise ValueError("%s: missing %s" % (OWN_LAUNCHER, ", ".join(missing) or "SCRIPT"))
    return opts, argv[i], argv[i + 1:]


def worker_env(opts, local_rank, base):
    """The variables ``init_process_group("env://")`` reads, as torchrun sets them."""
    nproc = int(opts["nproc-per-node"])
    env = dict(base)
    env.update({
        "RANK": str(int(opts["first-rank"]) + local_rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": opts["world-size"],
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": opts["node-rank"],
        "MASTER_ADDR": opts["master-addr"],
        "MASTER_PORT": opts["master-port"],
    })
    if nproc > 1 and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = "1"  # as torchrun does: N workers each using every core thrash
    return env


def worker_dir(log_dir, local_rank):
    """torchrun's layout, so the Tailer relays the logs and failures.py reads the error file:
    <log_dir>/none/attempt_0/<local_rank>/."""
    where = os.path.join(log_dir, "none", "attempt_0", str(local_rank))
    os.makedirs(where, exist_ok=True)
    return where


def root_cause(opts, local_rank, pid, code, lost=None):
    """torchrun's failure block, which the controller already knows how to read (``lost``: why the
    worker's own exit status is not known, said in the block)."""
    name = ""
    if code < 0:
        try:
            name = " (%s)" % signal.Signals(-code).name
        except ValueError:
            pass
    return ("=" * 60 + "\n%s FAILED (ddp-up launcher: none)\nRoot Cause (first observed failure):\n[0]:\n"
            "  time      : %s\n  host      : %s\n  rank      : %d (local_rank: %d)\n"
            "  exitcode  : %d (pid: %d)%s\n%s" + "=" * 60 + "\n") % (
                OWN_LAUNCHER, time.strftime("%Y-%m-%d_%H:%M:%S"), socket.gethostname(),
                int(opts["first-rank"]) + local_rank, local_rank, code, pid, name,
                "  unknown   : %s\n" % lost if lost else "")


class Workers:
    """`launcher: none`: this node's workers, each ``python -u SCRIPT ARGS``, started by the agent
    itself (a launcher process would be one more interpreter per node, paid N times on a big
    cluster), and stopped together when one fails, as torchrun does. To the Runner it looks like
    the launcher process it replaces: ``send_signal``, ``poll``, ``wait`` and an exit status
    (the first failure's, or 128 + the signal that stopped them); the first failure goes out as
    torchrun's Root Cause block on the launcher's stderr."""

    def __init__(self, launch, env, match, report, warm=None):
        self.opts, script, args = launch
        self.argv = [sys.executable, "-u", script] + list(args)
        self.warm = warm  # warm.Warm: the ranks forked from it (this attempt's own: run.WarmLine)
        self.env, self.match, self.report = env, match, report
        self.procs = {}  # Popen -> local rank
        self.ends = {}  # local rank -> when it ended (wall clock)
        self.exits = queue.SimpleQueue()  # (Popen, exit status), from a waiting thread per worker
        self.stopping = None  # the signal that asked them to stop (a failure is not reported then)
        self.not_started = False  # a worker could not be started: the others were stopped
        self.code = None
        self.done = threading.Event()

    def start(self, log_dir):
        for local_rank in range(int(self.opts["nproc-per-node"])):
            try:
                proc = self.start_one(log_dir, local_rank)
            except OSError as e:  # e.g. a full disk for its log files: the job fails as a launcher would
                self.report("%s: cannot start local rank %d: %s\n" % (OWN_LAUNCHER, local_rank, e))
                self.not_started = True
                self.signal_all(signal.SIGTERM)
                break
            self.procs[proc] = local_rank
            threading.Thread(target=self.wait_one, args=(proc, local_rank), daemon=True).start()
        if self.warm is not None:
            self.warm.close()  # every rank of this attempt asked for: it forks nothing more
        threading.Thread(target=self.watch, name="workers", daemon=True).start()

    def start_one(self, log_dir, local_rank):
        where = worker_dir(log_dir, local_rank)
        env = worker_env(self.opts, local_rank, self.env)
        env["TORCHELASTIC_ERROR_FILE"] = os.path.join(where, "error.json")  # where @record writes, as under torchrun
        paths = [os.path.join(where, name) for name in ("stdout.log", "stderr.log")]
        child = self.warm.fork(local_rank, self.argv[2:], env, os.getcwd(), *paths) if self.warm else None
        if child is not None:
            return child
        out, err = (open(path, "ab") for path in paths)
        try:
            return subprocess.Popen(self.argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    start_new_session=True)
        finally:
            out.close()
            err.close()

    def wait_one(self, proc, local_rank):
        code = proc.wait()
        self.ends[local_rank] = time.time()
        self.exits.put((proc, code))

    def watch(self):
        first_failure, kill_at, left = None, None, len(self.procs)
        in_stop = []  # the workers' own codes, as they ended in a stop
        while left:
            try:
                proc, code = self.exits.get(timeout=None if kill_at is None else max(0.0, kill_at - time.monotonic()))
            except queue.Empty:
                self.signal_all(signal.SIGKILL)  # survivors of a failure, past the grace
                kill_at = None
                continue
            left -= 1
            if self.stopping is not None:
                in_stop.append(code)
            if code != 0 and first_failure is None and self.stopping is None:
                first_failure = code
                self.report(root_cause(self.opts, self.procs[proc], proc.pid, code, getattr(proc, "lost", None)))
                self.signal_all(signal.SIGTERM)
                kill_at = time.monotonic() + FAIL_GRACE
        if first_failure is not None:
            self.code = first_failure if first_failure > 0 else 128 - first_failure
        elif self.not_started:
            self.code = 1
        else:  # a stop: the first worker's own code that is not 0 (a signal: 128+N), else 0 (all saved)
            own = next((c for c in in_stop if c != 0), 0)
            self.code = own if own >= 0 else 128 - own
        self.done.set()

    def signal_all(self, sig):
        for proc in self.procs:
            if proc.returncode is None:
                signal_tagged(proc.pid, sig, self.match)  # pinned and re-checked: never a recycled pid

    def send_signal(self, sig):
        if self.stopping is None:
            self.stopping = sig
        self.signal_all(sig)

    def ending(self):
        """The agent kills what is left: whatever exits now was not a failure of its own."""
        if self.stopping is None:
            self.stopping = signal.SIGKILL

    def poll(self):
        return self.code if self.done.is_set() else None

    def wait(self, timeout=None):
        if not self.done.wait(timeout):
            raise subprocess.TimeoutExpired(OWN_LAUNCHER, timeout)
        return self.code


def main(argv):
    """`launcher: none` in a container (container.py): this process, the container's first, is
    the launcher; ``argv`` is the Go's, after OWN_LAUNCHER. The agent outside signals it through
    the runtime: a stop_signal goes on to every worker, as the agent's own Workers would send it."""
    workers = Workers(parse_launch(argv), dict(os.environ), {k: os.environ[k] for k in TAGS if k in os.environ},
                      lambda text: (sys.stderr.write(text), sys.stderr.flush()))
    for name in JOB_SIGNALS:  # the stop_signal may be any of them
        signal.signal(getattr(signal, name), lambda sig, _frame: workers.send_signal(sig))
    workers.start(os.environ["PET_LOG_DIR"])
    sys.exit(workers.wait())
