"""The job's processes on this node: their tags, and finding, signalling and killing them.

Every process a launch starts inherits its tags (environment variables, readable in
/proc/PID/environ by the same user), so ddp-up finds and stops exactly what it started, and
nothing else, even across sessions (torchrun starts each worker in its own session) and after
the agent itself is gone.
"""

import os
import signal
import time

from ..userpython.names import STUB_MARK, TORCHRUN, WARM_MARK

TAG_JOB = "DDP_UP_JOB"
TAG_NODE = "DDP_UP_NODE"
TAG_CLUSTER = "DDP_UP_CLUSTER"
TAG_RUN = "DDP_UP_RUN"  # one launch: a job's own cleanup matches it too, so it can never touch another
TAG_ATTEMPT = "DDP_UP_ATTEMPT"  # 0, then 1, 2... as a job restarts (restarts:); a script resumes by it
TAGS = (TAG_JOB, TAG_NODE, TAG_CLUSTER, TAG_RUN, TAG_ATTEMPT)
TAG_KEEP = "DDP_UP_KEEP"  # a kept interpreter's (node/attempt/keep.py), or kept container's: a session's, no job's
JOB_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")  # a stop_signal, or ddp-kill --signal's


def spec_tags(spec, attempt):
    """The tags every process of attempt ``attempt`` of a RunSpec's launch carries."""
    return {TAG_JOB: spec.job, TAG_NODE: str(spec.node), TAG_CLUSTER: spec.cluster, TAG_RUN: spec.run,
            TAG_ATTEMPT: str(attempt)}

# An agent's name, the first word after its loader's on its command line (remote/protocol.title),
# and the first of the words it keeps there (main.main): ps and /proc/PID/cmdline name it by this.
AGENT_MARK = "ddp-up-agent"
EARLIER_AGENT_MARK = "'ddp_up_agent';"  # how an agent of an earlier version began its command line


def is_agent(proc):
    """Whether ``proc`` (find_tagged's) is a node agent: this version's, or a detached job's agent
    started by an earlier one (ddp-kill still stops it first)."""
    return AGENT_MARK in proc["cmd"] or EARLIER_AGENT_MARK in proc["cmd"]

KILL_WAIT = 3.0  # after SIGKILL, how long to wait for the kernel to reap before reporting


def proc_bytes(pid, name):
    """The bytes of /proc/PID/NAME, or None: the process is gone, or not ours to read."""
    try:
        with open("/proc/%d/%s" % (pid, name), "rb") as f:
            return f.read()
    except OSError:
        return None


def read_tags(pid):
    """The ddp-up tags in a process's initial environment (a job's, or a kept interpreter's and
    what it started), or None if it has none/is gone."""
    raw = proc_bytes(pid, "environ")
    if raw is None or (b"DDP_UP_JOB=" not in raw and b"DDP_UP_KEEP=" not in raw):  # most processes: no tags,
        return None  # and no per-variable work (a /proc scan reads every process's environment, on every agent's start and end)
    tags = {}
    for item in raw.split(b"\0"):
        if item.startswith(b"DDP_UP_"):
            key, _, value = item.partition(b"=")
            name = key.decode("ascii", "replace")
            if name in TAGS or name == TAG_KEEP:
                tags[name] = value.decode("utf-8", "replace")
    return tags if TAG_JOB in tags or TAG_KEEP in tags else None


def carries(tags, match):
    """Whether a process's tags (read_tags', None for none) include every (key, value) of ``match``."""
    return tags is not None and all(tags.get(k) == v for k, v in match.items())


def read_environ_value(pid, name):
    for item in (proc_bytes(pid, "environ") or b"").split(b"\0"):
        if item.startswith(name + b"="):
            return item[len(name) + 1:].decode("ascii", "replace")
    return None


def catches(pid, sig):
    """Whether the process has a handler for ``sig`` (so the signal cannot kill it)."""
    for line in (proc_bytes(pid, "status") or b"").splitlines():
        if line.startswith(b"SigCgt:"):
            try:
                return bool(int(line.split()[1], 16) >> (int(sig) - 1) & 1)
            except (IndexError, ValueError):
                return False
    return False


def is_alive(pid):
    """True unless gone or a zombie (a reaper may collect orphans a second or two late)."""
    stat = proc_bytes(pid, "stat")
    return stat is not None and stat[stat.rfind(b")") + 2:][:1] not in (b"Z", b"X", b"")


# In a launcher's command line (plan.py's; in a container, container.BOX_MAIN's of `launcher: none` and of warm
# start under torchrun; warm start's). A warm interpreter's children are the ranks, as a launcher's are, and
# it is never signalled as a rank is (its forked ranks take their own names); a stand-in is torchrun's
# worker, which asks the warm interpreter for the rank and passes signals on to it, never signalled as a rank.
LAUNCHER_MARKS = (TORCHRUN, "torch.distributed.launch", "ddp_up_box.launchers.workers", "ddp_up_box.launchers.boxwarm",
                  WARM_MARK, STUB_MARK)


def is_launcher(proc):
    """Whether a find_tagged process is a launcher (torchrun, the container's workers), by its command line."""
    return any(m in proc["cmd"] for m in LAUNCHER_MARKS)


def parent_of(pid):
    """The parent's pid, from /proc/PID/stat (its 4th field, after the command's parentheses), or None."""
    stat = proc_bytes(pid, "stat") or b""
    fields = stat[stat.rfind(b")") + 2:].split()
    return int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else None


def children(pid):
    """The pids of a process's children (every thread's), from /proc."""
    found = []
    try:
        tasks = os.listdir("/proc/%d/task" % pid)
    except OSError:
        return found
    for task in tasks:
        found.extend(int(c) for c in (proc_bytes(pid, "task/%s/children" % task) or b"").split())
    return found


def job_ranks(found):
    """The ranks among a job's tagged processes (find_tagged's): the children of its launchers
    (torchrun's workers) or of its agents (`launcher: none`), not those themselves, nor whatever
    a rank started (a data loader's worker would die of a signal its rank handles). The caller
    may be the agent itself (find_tagged leaves it out): its children are ranks too."""
    parents = {p["pid"] for p in found if is_agent(p) or is_launcher(p)}
    parents.add(os.getpid())
    return [p for p in found if p["pid"] not in parents and parent_of(p["pid"]) in parents]


def ranks_by_number(found):
    """{global rank: [pids]} of a job's tagged processes (find_tagged's) that carry a RANK their
    parent does not: the rank, and a warm rank's torchrun stand-in beside it (the rank itself is
    the warm interpreter's child, not torchrun's: job_ranks finds the stand-in alone), never a
    launcher, the warm interpreter, or what a rank started (a data loader's worker)."""
    candidates = [p for p in found if not is_launcher(p)]
    rank_of = {p["pid"]: read_environ_value(p["pid"], b"RANK") for p in candidates}
    ranks = {}
    for pid, rank in rank_of.items():
        if rank and rank.isdigit() and rank_of.get(parent_of(pid)) != rank:
            ranks.setdefault(int(rank), []).append(pid)
    return ranks


def signal_ranks(sig, match, ranks=None):
    """``sig`` straight to each of the job's ranks (``ranks``: job_ranks' of what carries
    ``match``), never to a launcher, which would take it for a stop. The pids it reached."""
    ranks = job_ranks(find_tagged(match)) if ranks is None else ranks
    return [p["pid"] for p in ranks if signal_tagged(p["pid"], sig, match)]


def _cmdline(pid):
    return (proc_bytes(pid, "cmdline") or b"").replace(b"\0", b" ").decode("utf-8", "replace").strip()


def own_pids():
    """The pids of this user's processes but this one (/proc; none where there is no /proc)."""
    me, uid = os.getpid(), os.getuid()
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    pids = []
    for name in names:
        if not name.isdigit() or int(name) == me:
            continue
        try:
            if os.stat("/proc/%s" % name).st_uid == uid:
                pids.append(int(name))
        except OSError:
            continue
    return pids


def find_tagged(match):
    """Live processes of this user whose tags include every (key, value) in ``match``."""
    found = []
    for pid in own_pids():
        tags = read_tags(pid)
        if not carries(tags, match):
            continue
        if is_alive(pid):
            found.append({"pid": pid, "tags": tags, "cmd": _cmdline(pid)[:200]})
    return found


def signal_tagged(pid, sig, match):
    """Send ``sig`` to ``pid`` only if it still carries the tags in ``match``.

    With pidfd (Linux 5.3+, Python 3.9+) the pid is pinned before the tags are re-read, so a
    recycled pid can never receive the signal.
    """
    fd = None
    try:
        if hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal"):
            fd = os.pidfd_open(pid)
        if not carries(read_tags(pid), match):
            return False
        if fd is not None:
            signal.pidfd_send_signal(fd, sig)
        else:
            os.kill(pid, sig)
        return True
    except OSError:  # gone already, or not ours to signal
        return False
    finally:
        if fd is not None:
            os.close(fd)


def wait_gone(pids, timeout):
    """Poll /proc until none of ``pids`` is alive or the timeout passes; return survivors."""
    deadline = time.monotonic() + timeout
    left = [p for p in pids if is_alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if is_alive(p)]
    return left


def kill_tagged(match, grace, first_signal=signal.SIGTERM):
    """SIGTERM (or ``first_signal``) every matching process, wait ``grace``, SIGKILL survivors."""
    procs = find_tagged(match)
    pids = [p["pid"] for p in procs]
    sent = [pid for pid in pids if signal_tagged(pid, first_signal, match)]
    survivors = wait_gone(sent, grace) if first_signal != signal.SIGKILL else sent
    killed = [pid for pid in survivors if signal_tagged(pid, signal.SIGKILL, match)]
    left = wait_gone(killed, KILL_WAIT)
    return {"found": procs, "killed": killed, "left": left}


def signal_name(code):
    if code is None or code >= 0:
        return None
    try:
        return signal.Signals(-code).name
    except ValueError:
        return "signal %d" % -code


JOB_TMPDIR = "DDP_UP_JOB_TMPDIR"  # TMPDIR as `setup:` left it (transport.setup_script): the job's


def job_env(extra):
    """The environment the job gets: this agent's (after `setup:`, TMPDIR included), then the
    plan's `env`."""
    env = dict(os.environ)
    after_setup = env.pop(JOB_TMPDIR, None)
    if after_setup is not None:
        env.pop("TMPDIR", None)
        if after_setup.startswith("set:"):
            env["TMPDIR"] = after_setup[4:]
    env.update(extra or {})
    return env
