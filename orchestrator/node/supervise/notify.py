"""Telling the user away from the screen: an event as JSON, to a webhook or a command.

Stdlib only: a detached job's supervisor (in the master node's agent) sends its events from here,
and ddp-up sends an attached job's webhook and command targets with the same code (Apprise URLs
are the controller's: notify.py). One event, one JSON object::

    {"event": "ended", "job_id": "...", "text": "job ... failed after 12.3 s: ...", "time": "...Z",
     "host": "...", ...fields of the event}

Events: ended (ok or failed, with the root cause), restart, hang, straggler, signal (stopped by
one), lost (a detached job's node lost its supervisor for good). A target that fails is reported
once by its owner and never changes the job: every send is bounded by TIMEOUT, on a thread.
"""

import json
import os
import signal
import socket
import subprocess
import threading
import time

from ..protocol import wire
from ..watch.relay import masked
from .decide import describe_end

EVENTS = ("ended", "restart", "hang", "straggler", "signal", "lost")
TIMEOUT = 10.0  # seconds one target may take
DETACHED_KINDS = ("webhook", "command")  # what a detached job's nodes can send (no Apprise there)


def event(kind, job_id, text, **fields):
    """The event's JSON object (``fields``: the kind's own, e.g. exit_code, root_cause)."""
    return dict(fields, event=kind, job_id=job_id, text=text, host=socket.gethostname(),
                time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


def post(url, payload, timeout=TIMEOUT):
    """POST the event's JSON to ``url``; an HTTP error or no answer raises (OSError)."""
    import urllib.request  # only where a webhook is set: a tenth of the agent's start otherwise

    request = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "User-Agent": "ddp-up"})
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        answer.read(65536)


STDERR_KEPT = 4096  # bytes of a command's stderr kept for its failure's words


def run(command, payload, timeout=TIMEOUT):
    """Run ``command`` (the user's own shell line, from their cluster file) with the event's JSON
    on stdin; in a session of its own, so a timeout kills all of it. Raises OSError on a failure."""
    env = dict(os.environ, DDP_UP_EVENT=payload.get("event", ""), DDP_UP_JOB=payload.get("job_id", ""))
    proc = subprocess.Popen(["/bin/sh", "-c", command], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True, env=env)
    tail = bytearray()  # the end of what it says on stderr: bounded, however much it says

    def drain():
        for chunk in iter(lambda: proc.stderr.read(1 << 16), b""):
            tail[:] = (tail + chunk)[-STDERR_KEPT:]
    reader = threading.Thread(target=drain, name="notify-stderr", daemon=True)
    reader.start()
    try:
        proc.stdin.write(json.dumps(payload).encode() + b"\n")
        proc.stdin.close()
    except OSError:
        pass  # it does not read its stdin: its choice
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise OSError("it ran past %g s and was killed" % timeout) from None
    finally:
        reader.join(1.0)
    if proc.returncode != 0:
        last = bytes(tail).decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
        raise OSError("it exited with %d%s" % (proc.returncode, (": " + last[0][:200]) if last[0] else ""))


SENDERS = {"webhook": post, "command": run}


def wanted(target, kind):
    """target: [kind, value, events or None]."""
    return target[2] is None or kind in target[2]


class Deliveries:
    """Sends events to targets on threads; each target's first failure goes to ``report`` (once);
    ``wait`` bounds how long the end waits for sends under way."""

    def __init__(self, targets, report, senders=None):
        self.targets = list(targets)
        self.report = report
        self.senders = senders or SENDERS
        self.failed = set()
        self.threads = []
        self.lock = threading.Lock()

    def send(self, payload):
        for index, target in enumerate(self.targets):
            if wanted(target, payload["event"]):
                thread = threading.Thread(target=self._one, args=(index, target, payload), name="notify", daemon=True)
                thread.start()
                self.threads.append(thread)

    def _one(self, index, target, payload):
        try:
            self.senders[target[0]](target[1], payload)
        except Exception as e:  # noqa: BLE001 - a notification never reaches into the job
            with self.lock:
                first = index not in self.failed
                self.failed.add(index)
            if first:
                self.report(index, target[0], str(e) or type(e).__name__)

    def wait(self, timeout=TIMEOUT + 2):
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))


def root_text(root):
    """A detached attempt's root cause (decide.attempt_summary's), in words."""
    if not root:
        return None
    where = "node %s" % root["node"] if root.get("node") is not None else "the job"
    rank = " rank %s" % root["rank"] if root.get("rank") is not None else ""
    exception = ": %s" % root["exception"] if root.get("exception") else ""
    return "%s%s %s%s" % (where, rank, describe_end(root["state"], root.get("code"), root.get("reason")), exception)


class JobNotices:
    """A detached job's events, sent from its nodes' agents (only webhook and command targets:
    DETACHED_KINDS): the supervisor's ended, restart and hang, and a node's lost (its supervisor
    gone for good). A target's failure is told once, as a line of the node's in the job's journal."""

    def __init__(self, spec, writer):
        self.spec, self.out = spec, writer
        self.deliveries = Deliveries([t for t in spec.notify or () if t[0] in DETACHED_KINDS], self._failed)

    def send(self, kind, text, **fields):
        if self.deliveries.targets:
            self.deliveries.send(masked(event(kind, self.spec.job, text, **fields), self.out.secrets))

    def ended(self, summary, reason):
        """The job's end (the supervisor's outcome: attempt_summary's), then a bounded wait for the
        sends, before the agent exits."""
        ok = all(st["state"] == "done" for st in summary["nodes"].values())
        root = root_text(summary.get("root_cause"))
        text = "job %s %s after %d attempt(s)%s" % (self.spec.job, "ok" if ok else "failed", summary["attempt"] + 1,
                                                    "; root cause: %s" % root if root and not ok else "")
        self.send("ended", text + ("" if ok or not reason or root else " (%s)" % reason), ok=ok, root_cause=root,
                  attempts=summary["attempt"] + 1, detached=True)
        self.deliveries.wait()

    def _failed(self, index, kind, why):
        line = "ddp-up: notify[%d] (%s) failed: %s; the job is not affected (told once)\n" % (index, kind, why)
        self.out.send(wire.Output("err", None, masked(line, self.out.secrets).encode()))
