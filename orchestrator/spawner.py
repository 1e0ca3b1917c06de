"""ddp-up's own launcher, for ``launcher: none``: start this node's workers the way
``torch.distributed.launch`` did, without torchrun, and stop them all when one fails.

Shipped to the node as text in the agent's spec and run by the agent in place of torchrun, so it
keeps torchrun's contract with the agent: the workers' output goes to
``$PET_LOG_DIR/none/attempt_0/<local_rank>/std{out,err}.log`` (the agent's tailer relays it),
and a failure is reported in torchrun's "Root Cause" block (the controller reads rank and exit
code from it). Stdlib only, Python 3.8+.

Each worker runs ``python -u SCRIPT ARGS`` with the variables ``init_process_group("env://")``
reads: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT.
"""

import datetime
import os
import signal
import socket
import subprocess
import sys
import time

OPTIONS = ("nproc-per-node", "node-rank", "first-rank", "world-size", "master-addr", "master-port")
GRACE = 5.0  # after one worker failed: SIGTERM to the others, this long, then SIGKILL
POLL = 0.05


def parse(argv):
    """``--name=value`` options (all of OPTIONS), then SCRIPT and its arguments, untouched."""
    opts, i = {}, 0
    while i < len(argv) and argv[i].startswith("--") and "=" in argv[i]:
        name, _, value = argv[i][2:].partition("=")
        if name not in OPTIONS:
            raise SystemExit("ddp-up-launch: unknown option --%s" % name)
        opts[name] = value
        i += 1
    missing = [n for n in OPTIONS if n not in opts]
    if missing or i >= len(argv):
        raise SystemExit("ddp-up-launch: usage: %s SCRIPT [ARGS...] (missing: %s)"
                         % (" ".join("--%s=..." % n for n in OPTIONS), ", ".join(missing) or "SCRIPT"))
    return opts, argv[i], argv[i + 1:]


def worker_env(opts, local_rank, base):
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


def log_files(log_dir, local_rank):
    where = os.path.join(log_dir, "none", "attempt_0", str(local_rank))
    os.makedirs(where, exist_ok=True)
    return (open(os.path.join(where, "stdout.log"), "ab"), open(os.path.join(where, "stderr.log"), "ab"))


def exit_code(status):
    """waitpid status -> Popen-style return code (negative: killed by that signal)."""
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def root_cause(opts, local_rank, pid, code):
    """torchrun's failure block, which the controller already knows how to read."""
    stamp = datetime.datetime.now().replace(microsecond=0).isoformat(sep="_")
    name = ""
    if code < 0:
        try:
            name = " (%s)" % signal.Signals(-code).name
        except ValueError:
            pass
    return ("=" * 60 + "\n%s FAILED (ddp-up launcher: none)\nRoot Cause (first observed failure):\n[0]:\n"
            "  time      : %s\n  host      : %s\n  rank      : %d (local_rank: %d)\n"
            "  exitcode  : %d (pid: %d)%s\n" + "=" * 60 + "\n") % (
                sys.argv[0], stamp, socket.gethostname(), int(opts["first-rank"]) + local_rank, local_rank,
                code, pid, name)


class Workers:
    def __init__(self, opts, script, args):
        self.opts = opts
        self.argv = [sys.executable, "-u", script] + list(args)
        self.running = {}  # pid -> local rank
        self.first_failure = None  # (local rank, pid, code)
        self.stopping = None  # signal number that asked us to stop
        self.deadline = None  # when survivors of a failure get SIGKILL

    def start(self, log_dir):
        for local_rank in range(int(self.opts["nproc-per-node"])):
            if self.stopping:
                return  # asked to stop while starting: the ones started get the signal already
            out, err = log_files(log_dir, local_rank)
            try:
                proc = subprocess.Popen(self.argv, env=worker_env(self.opts, local_rank, os.environ),
                                        stdin=subprocess.DEVNULL, stdout=out, stderr=err)
            finally:
                out.close()
                err.close()
            self.running[proc.pid] = local_rank

    def signal_all(self, sig):
        for pid in list(self.running):
            try:
                os.kill(pid, sig)
            except OSError:
                pass  # exited; reaped below

    def on_signal(self, signum, _frame):
        self.stopping = signum
        self.signal_all(signum)

    def reap(self):
        """Collect exited workers; on the first failure, stop the rest (fail fast)."""
        while self.running:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                self.running.clear()
                return
            if pid == 0:
                return
            local_rank = self.running.pop(pid, None)
            code = exit_code(status)
            if local_rank is not None and code != 0 and self.first_failure is None and self.stopping is None:
                self.first_failure = (local_rank, pid, code)
                sys.stderr.write(root_cause(self.opts, local_rank, pid, code))
                sys.stderr.flush()
                self.signal_all(signal.SIGTERM)
                self.deadline = time.monotonic() + GRACE

    def wait(self):
        while self.running:
            self.reap()
            if self.deadline is not None and time.monotonic() > self.deadline:
                self.signal_all(signal.SIGKILL)
                self.deadline = None
            time.sleep(POLL)
        if self.first_failure is not None:
            code = self.first_failure[2]
            return code if code > 0 else 128 - code
        return 128 + self.stopping if self.stopping else 0


def main(argv):
    opts, script, args = parse(argv)
    workers = Workers(opts, script, args)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, workers.on_signal)
    workers.start(os.environ.get("PET_LOG_DIR") or os.path.join(os.getcwd(), "ddp-up-logs"))
    return workers.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
