"""What a preflight looks at on this node, and what it holds: the workdir and script, the torch
the job would import, the GPUs it would see, a state directory of its own, the master port (held,
with every probe of it answered, until Go) and the path from here to the master's.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

from ..launchers import image
from ..local.ourcode import source_of
from ..local.procs import TAG_ATTEMPT, TAG_JOB, TAG_NODE, find_tagged
from ..local.state import JOB_ID, claim_node_dir, job_in_use
from ..probes import facts, gpuhealth
from ..protocol import wire
from ..userpython import torchprobe


def listen_on(port, addr=""):
    """A listening socket on ``port`` (0: one the OS picks) on ``addr`` (every address of this
    node unless given)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # Inherited by the probes it accepts: one still closing when torchrun's store binds the port
    # (with SO_REUSEADDR, as c10d does) is then no obstacle. A second listener is refused as ever.
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((addr, port))
        s.listen(1024)
    except OSError:
        s.close()
        raise
    return s


def answer_probes(listener):
    """Accept every probe while the port is held. Unaccepted, they would fill the backlog, and the
    nodes after it would time out (128 nodes did). Each prober closes first, so the TIME_WAIT
    stays on its side and torchrun can bind this port the moment it is released."""
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return  # shut down at go
        try:
            conn.settimeout(PROBE_CLOSE_WAIT)
            conn.recv(1)  # b"": the prober has closed
        except OSError:
            pass
        finally:
            conn.close()


PROBE_CLOSE_WAIT = 5.0


def probe_torch(env, *more):
    """{"torch", "cuda", "nccl"} versions the job would use (and ``more``'s: "cloudpickle"), or None
    if it has no torch."""
    try:
        out = subprocess.run([sys.executable, "-c", source_of(torchprobe), *more], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, timeout=60).stdout
        info = json.loads(out.decode().strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
    return info if info.get("torch") else None


def versions(spec, env, box, out):
    """({"torch", "cuda", "nccl"} the job will run, None) or (None, the Failed frame): the host's
    python's, or, in a container, the image's (image.preflight, its pull's lines on ``out``)."""
    def say(text):
        out.send(wire.Output("err", None, (text + "\n").encode("utf-8", "replace")))

    if box is not None:
        return image.preflight(box, source_of(torchprobe), spec.needs_torch, say)
    # a process per node, paid N times on a big cluster: only where the launcher needs torch
    calls = CALL_HOOK in (spec.hooks or {})
    info = probe_torch(env, *(["cloudpickle"] if calls else [])) if spec.needs_torch or calls else {}
    if info is None:
        return None, no_torch()
    if calls and not info.get("cloudpickle"):
        return None, no_cloudpickle(info.get("cloudpickle_error"))
    return info, None


def check_paths(spec):
    """None, or the Failed frame for a missing workdir or script; the agent is in the workdir after."""
    workdir = os.path.expanduser(spec.workdir or "~")
    if not os.path.isdir(workdir):
        return wire.Failed("workdir %s does not exist" % workdir,
                           "create it on this node, or set `workdir:` in the cluster file")
    os.chdir(workdir)
    if spec.script and spec.script != "-m" and not os.path.isfile(spec.script):  # -m: a module, found when it runs
        return wire.Failed("script %s not found in %s" % (spec.script, workdir),
                           "copy it to this node, or set `workdir:` to the directory that holds it")
    return None


CALL_HOOK = "ddp_up_call.py"  # a function's launch: the runner (plan/rank_call.py) among the hooks


def no_cloudpickle(error):
    why = " (%s)" % error[:200] if error else ""
    return wire.Failed("cloudpickle cannot be imported by %s%s: the function is shipped with it" % (sys.executable, why),
                       "install it on this node: %s -m pip install cloudpickle" % sys.executable)


def no_torch():
    return wire.Failed("torch is not installed for %s (Python %s)" % (sys.executable, sys.version.split()[0]),
                       "install torch on this node, or set `python:` to an interpreter that has it")


def claim_state(spec):
    """(this node's private state directory, None), created exclusively, or (None, Failed): a job
    id in use here (a directory, or live processes of it) is refused before anything starts."""
    job, node = spec.job, spec.node
    if not JOB_ID.fullmatch(job):
        return None, wire.Failed("job id %r is not a plain name" % job[:80], "use the same ddp-up version everywhere")
    others = find_tagged({TAG_JOB: job, TAG_NODE: str(node), TAG_ATTEMPT: str(spec.attempt)})
    if others:
        return None, job_in_use(job, "pid %d carries its tags" % others[0]["pid"])
    return claim_node_dir(job, node, spec.attempt, spec.cluster)


def hold_port(spec):
    """(the master port held until Go, or None where this node is not the master; None) or (None,
    the Failed frame for a port that is taken)."""
    port = spec.check_port
    if not (port or spec.pick_port):
        return None, None
    try:
        return PortHold(port or 0), None
    except OSError:
        return None, wire.Failed("master port %d is already in use on the master node" % port,
                                 "set `master: {port: auto}` or pick another port")


# `master: {port: auto}`: a port below the kernel's ephemeral range. Between its release at Go and
# the bind of torchrun's store, a port the kernel handed out once (bind to 0) can be handed out again
# to any outgoing connection on the node (an ssh, a download): the store then failed with EADDRINUSE.
# Below the range the kernel hands out nothing; only a program that names the port could take it.
AUTO_PORTS = 20000  # the lowest port picked (above the well-known and most registered services')
AUTO_TRIES = 20  # random ports tried before the kernel's pick is taken after all


def below_ephemeral(tries=AUTO_TRIES, draw=None):
    """A free listening socket on a random port from AUTO_PORTS up to the ephemeral range's start
    (/proc/sys/net/ipv4/ip_local_port_range), or None where there is no such room, or none free."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            first = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if first <= AUTO_PORTS:
        return None
    draw = draw or (lambda: AUTO_PORTS + int.from_bytes(os.urandom(2), "big") % (first - AUTO_PORTS))
    for _ in range(tries):
        try:
            return listen_on(draw())
        except OSError:
            continue
    return None


class PortHold:
    """The master port, from preflight to Go: held, so nothing else takes it, and every node's
    probe of it answered, so each proves it reaches the master for real. OSError if it is taken.
    0: a free one of our choice (below_ephemeral)."""

    def __init__(self, port):
        self.listener = (port == 0 and below_ephemeral()) or listen_on(port)
        self.port = self.listener.getsockname()[1]
        self.answering = threading.Thread(target=answer_probes, args=(self.listener,), name="probes", daemon=True)
        self.answering.start()

    def close(self):
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept in answer_probes
        except OSError:
            pass
        self.listener.close()
        # the probe being answered ends too: no socket of ours is left on the port for torchrun
        self.answering.join(PROBE_CLOSE_WAIT)


def probe(target, env):
    """Can this node open a TCP connection to the master's address and port? The Probed frame,
    with the interfaces that route there (see facts.network_facts)."""
    found = facts.network_facts(target.addr, env)
    try:
        socket.create_connection((target.addr, target.port), timeout=target.timeout).close()
        return wire.Probed(ok=True, **found)
    except OSError as e:
        return wire.Probed(ok=False, error=e.strerror or str(e) or type(e).__name__, **found)


def ready(spec, torch, env, port, supervisor_port):
    """The Ready frame: what this node is, for the controller's cross-node checks. Its clock is
    read last, as the frame goes: a slow nvidia-smi before it is no clock skew."""
    busy = facts.query_busy_gpus(env.get("CUDA_VISIBLE_DEVICES"), spec.nproc) or None
    health = gpuhealth.query_health(env.get("CUDA_VISIBLE_DEVICES"), spec.nproc) or None
    return wire.Ready(
        hostname=socket.gethostname(), python=sys.version.split()[0], torch=torch.get("torch"),
        cuda=torch.get("cuda"), nccl=torch.get("nccl"), gpus=facts.count_gpus(env), disk_free=shutil.disk_usage(".").free,
        port=port, supervisor_port=supervisor_port, busy_gpus=busy, gpu_health=health, time=time.time())
