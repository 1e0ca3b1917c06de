"""The image a `container:` job runs, as its preflight finds it: the runtime there, the mounts'
host sides, the image present (pulled where the cluster file says so), and the versions the job
will see inside it, read in a container of the image once per image and kept (versions_key).
"""

import json
import os
import re
import shutil
import subprocess
import time

from ..local.state import STATE_MOST, open_regular, private_dir, state_root, write_private
from ..protocol import wire
from .container import PROBE_WAIT, mount_ends, run_bounded


MISSING_IMAGE = re.compile(r"no such image|image not known|not found|unable to find", re.I)


def preflight(box, probe, needs_torch, say):
    """The runtime, the mounts and the image (pulled as ``pull`` says, its lines through
    ``say``), then the versions inside it (``probe``, Python code that prints them as JSON):
    ({"torch", "cuda", "nccl"}, None) or (None, the Failed frame naming the key to fix)."""
    ident, problem = None, check_runtime(box) or check_mounts(box)
    if problem is None:
        ident, problem = check_image(box, say)
    if problem:
        return None, problem
    key = versions_key(box, ident)
    info = read_versions(key)
    if info is None:
        info, problem = probe_image(box, probe)
        if problem:
            return None, problem
        keep_versions(key, info)
    if needs_torch and not info.get("torch"):
        return None, wire.Failed("torch is not installed for %s in image %s" % (box.python, box.image),
                                 "use an image with torch, or set `container: {python: ...}` to the interpreter that has it")
    return info, None


def probe_image(box, probe):
    """(the versions ``probe`` prints in a container of the image, None) or (None, Failed)."""
    code, out, err = run_bounded(box.run_argv([box.python, "-c", probe], name=box.name + "-probe"), PROBE_WAIT)
    try:
        info = json.loads(out.strip().splitlines()[-1])
        if isinstance(info, dict):
            return info, None
    except (ValueError, IndexError):
        pass
    return None, wire.Failed("%s in image %s cannot run: %s" % (box.python, box.image, last_line(err) or "exit %s" % code),
                             "set `container: {python: ...}` to the image's interpreter, or check the image")


# The versions an image holds are read once per image and node: a container's start is a second
# or more (paid per node, per job and per restart), the image's content never changes under its
# id. The key also holds what else the answer depends on: the interpreter, the mounts, the options.
def versions_key(box, ident):
    """The file name the versions of the image with id ``ident`` (a daemon's) are kept under in the
    state root; None without an id."""
    if not ident:
        return None
    import hashlib  # here, not at the top: every agent imports this module, few ever get here

    facts_of = [box.runtime, ident, box.python, box.mounts, box.options]
    return ".versions-%s.json" % hashlib.sha256(json.dumps(facts_of).encode()).hexdigest()[:32]


def read_versions(key):
    root = state_root()
    if key is None or private_dir(root, create=False):
        return None
    fd = open_regular(os.path.join(root, key))
    if fd is None:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            info = json.loads(f.read(STATE_MOST))
            os.utime(f.fileno())  # used now: keep_versions forgets only those unused for VERSIONS_KEPT
    except (OSError, ValueError, RecursionError):
        return None
    return info if isinstance(info, dict) else None


VERSIONS_KEPT = 30 * 86400.0  # seconds an image's versions are kept unread: images come and go


def keep_versions(key, info, now=None):
    """Keep ``info`` under ``key``; and forget the versions of images not used for VERSIONS_KEPT
    (each file is a few hundred bytes, but a node that sees an image a day would keep them all)."""
    root = state_root()
    if key is None or private_dir(root):  # the state root is private, or nothing is kept
        return
    try:
        write_private(os.path.join(root, key), json.dumps(info))
    except OSError:  # another node of the same host wrote it first
        pass
    now = time.time() if now is None else now
    for name in os.listdir(root):
        path = os.path.join(root, name)
        try:
            if name.startswith(".versions-") and now - os.lstat(path).st_mtime > VERSIONS_KEPT:
                os.unlink(path)
        except OSError:
            pass


def check_runtime(box):
    if shutil.which(box.exe) is None:
        what = "srun (pyxis)" if box.runtime == "pyxis" else box.runtime
        return wire.Failed("container runtime %s is not installed on this node (not on PATH)" % what,
                           "install it, or set `container: {runtime: ...}` to the one this node has")
    if box.runtime == "pyxis":
        code, out, _ = box.runtime_cmd(["--help"])
        if "--container-image" not in out:
            return wire.Failed("this cluster's srun has no --container-image (the pyxis plugin is not installed)",
                               "ask its admins for pyxis, or use `runtime: enroot` or `apptainer`")
    return None


def check_mounts(box):
    ours = [os.path.normpath(b) for b in box.binds]
    for i, m in enumerate(box.mounts):
        source, target = mount_ends(m)
        if not os.path.exists(source):
            return wire.Failed("container.mounts[%d]: %s does not exist on this node" % (i, source),
                               "create it on this node, or fix the mount in the cluster file")
        if target in ours:
            return wire.Failed("container.mounts[%d]: %s would be mounted at %s, where ddp-up mounts the job's %s"
                               % (i, source, target, "workdir" if target == ours[0] else "state directory"),
                               "mount it at another path, or set `workdir:` to it")
    return None


def image_id(box):
    """(exit status, the image's id, stderr) of the runtime's ``image inspect``."""
    code, out, err = box.runtime_cmd(["image", "inspect", "--format", "{{.Id}}", box.image])
    return code, out.strip(), err


def check_image(box, say):
    """(the image's id where its runtime has one, None) once the image is here (pulled if
    ``pull`` says so), else (None, the Failed frame)."""
    if not box.daemon:
        local = box.runtime != "pyxis" and ("/" in box.image or box.image.endswith((".sif", ".sqsh")))
        if local and "://" not in box.image and not os.path.exists(box.image):
            return None, wire.Failed("container.image %s does not exist on this node" % box.image,
                                     "copy the image file there, or give its path on the node")
        return None, None
    if box.pull != "always":
        code, ident, err = image_id(box)
        if code == 0:
            return ident, None
        if code is None or not MISSING_IMAGE.search(err):
            return None, wire.Failed("container runtime %s cannot be used: %s" % (box.runtime, last_line(err)),
                                     "check that `%s info` works for this user on this node" % box.runtime)
        if box.pull == "never":
            return None, wire.Failed("container.image %s is not on this node, and `pull: never`" % box.image,
                                     "pull or load it there (%s pull/load), or set `pull: missing`" % box.runtime)
    problem = pull_image(box, say)
    code, ident, _ = image_id(box) if problem is None else (None, None, "")
    return (ident if code == 0 else None), problem


def pull_image(box, say):
    say("pulling %s with %s" % (box.image, box.runtime))
    try:
        proc = subprocess.Popen([box.exe, "pull", box.image], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
    except OSError as e:
        return wire.Failed("cannot run %s pull: %s" % (box.runtime, e), "check the runtime on this node")
    last = ""
    for raw in proc.stdout:  # the runtime's progress, a line at a time, for the dashboard
        last = raw.decode("utf-8", "replace").strip() or last
        say(last)
    if proc.wait() != 0:
        return wire.Failed("container.image %s could not be pulled: %s" % (box.image, last),
                           "check the image's name and the registry's login on this node, or load it there")
    return None


def last_line(text):
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""
