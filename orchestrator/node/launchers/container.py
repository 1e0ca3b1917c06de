"""`container:`: the job's launcher inside an image, its agent outside it, on the host.

The agent keeps the container's whole life: it checks the runtime and the image in preflight
(pulling it if told to), reads the versions the job will see from inside the image, starts the
launcher in a container named and labelled after the job, node and attempt, signals it, and
removes it at every end. A docker or podman container belongs to its daemon (or conmon), not to
the process that asked for it: killing the client leaves it running, so every stop goes through
the runtime, by name, and ddp-kill finds leftovers by label. Apptainer, enroot and pyxis (an srun
step) run the container as the agent's own child process: signalling that child is enough.

The job's environment never reaches a command line, nor the container's configuration (which
``docker inspect`` shows to anyone who may use the runtime): it goes in a private file in the
node's state directory, mounted into the container, read by the container's first process
(LOADER), which then becomes the launcher.
"""

import json
import os
import shutil
import subprocess

from ..local.procs import TAGS, TAG_ATTEMPT, TAG_CLUSTER, TAG_JOB, TAG_KEEP, TAG_NODE, TAG_RUN, spec_tags
from ..local.state import write_private
from ..probes import facts
from .workers import OWN_LAUNCHER

DAEMON_RUNTIMES = ("docker", "podman")  # the container outlives its client: stopped and removed by name
CHILD_RUNTIMES = ("apptainer", "singularity", "enroot", "pyxis")  # the container is the client's own process
RUNTIMES = DAEMON_RUNTIMES + CHILD_RUNTIMES
PULLS = ("never", "missing", "always")
LABELS = ((TAG_JOB, "ddp-up.job"), (TAG_NODE, "ddp-up.node"), (TAG_ATTEMPT, "ddp-up.attempt"),
          (TAG_CLUSTER, "ddp-up.cluster"), (TAG_RUN, "ddp-up.run"), (TAG_KEEP, "ddp-up.keep"))
ENV_FILE = "container-env.json"
COMMAND_WAIT = 60.0  # a runtime's quick commands (inspect, kill, rm, ps): a daemon under load is slow
PULL_WAIT = 1800.0  # an image of 20 GB over a slow link
PROBE_WAIT = 120.0  # the versions, read in a container of the image (a cold start reads a big image)

# Node code a container's first process runs in the image, from the package BOX_PACKAGE (RunSpec.box_code)
# written beside the env file (argv[1]): `launcher: none`'s workers.main (the Go's options and the script
# follow), or warm start's boxwarm.main (its own arguments, then the launcher's command line: torchrun's or the Go's).
BOX_PACKAGE = "ddp_up_box"
CODE_DIR = ".code"  # the package's directory: the env file's path and this
BOX_MAIN = "import sys;sys.path.insert(0,sys.argv[1]);from ddp_up_box.%s import main;sys.exit(main(sys.argv[2:]))"

# The container's first process: the job's environment from the private file (argv[1]), the
# workdir (argv[2]), then the launcher (argv[3:]) in its place, so it carries the tags.
LOADER = ("import json,os,sys;a=sys.argv;f=open(a[1]);os.environ.update(json.load(f));f.close();"
          "os.chdir(a[2]);os.execvp(a[3],a[3:])")


def box_for(spec, attempt, state_dir, env):
    """The container of attempt ``attempt`` of a RunSpec's job on this node (the agent is in its
    workdir), or None where the job runs on the host."""
    return Box(spec.container, spec_tags(spec, attempt), os.getcwd(), binds=(state_dir,),
               gpus=gpu_ids(env, spec.nproc)) if spec.container else None


def container_name(tags):
    """``ddp-up-JOB-nN-aA``: one per job, node and attempt (a job id is a plain name: state.JOB_ID);
    ``ddp-up-keep-NAME`` for a warm container kept across launches (keptbox.py)."""
    keep = tags.get(TAG_KEEP)
    return "ddp-up-keep-%s" % keep if keep else "ddp-up-%s-n%s-a%s" % (tags[TAG_JOB], tags[TAG_NODE], tags.get(TAG_ATTEMPT, "0"))


UID_LABEL = "ddp-up.uid"  # the user who started it: a shared docker daemon holds every user's containers


def label_filters(match):
    """``--filter label=...`` for every tag of ``match`` that containers carry as a label, and
    always this user's uid: a ddp-kill of a cluster file that several users share removes only
    the containers of the user who runs it."""
    names = dict(LABELS)
    pairs = ["label=%s=%s" % (names[key], value) for key, value in sorted(match.items()) if key in names]
    pairs = (pairs or ["label=ddp-up.job"]) + ["label=%s=%d" % (UID_LABEL, os.getuid())]  # no tag: every job's
    return [arg for pair in pairs for arg in ("--filter", pair)]


def gpu_ids(env, nproc):
    """The GPUs this node's job uses, as the runtime names them: the first ``nproc`` of
    CUDA_VISIBLE_DEVICES (indices or UUIDs), else 0..nproc-1; none where the node has no NVIDIA GPU."""
    if not facts.has_nvidia_gpus():
        return []
    visible = env.get("CUDA_VISIBLE_DEVICES")
    ids = facts.visible_ids(visible) if visible is not None else [str(i) for i in range(nproc or 1)]
    return ids[:nproc] if nproc else ids


class Box:
    """One attempt's container on this node: its commands (run, signal, remove), per runtime.
    ``conf``: RunSpec.container; ``tags``: the launch's; ``binds``: host directories the job
    needs at the same path inside (the workdir, the node's state directory)."""

    def __init__(self, conf, tags, workdir, binds=(), gpus=(), user=None):
        self.runtime, self.image = conf["runtime"], conf["image"]
        self.python = conf.get("python") or "python3"
        self.pull = conf.get("pull") or "missing"
        self.options = list(conf.get("options") or ())
        self.tags, self.workdir = tags, workdir
        self.binds = [b for b in dict.fromkeys((workdir,) + tuple(binds)) if b]
        # a mount of the workdir onto itself is ours already: a second one is podman's "duplicate
        # mount destination"; another source at the workdir's path is refused in preflight
        self.mounts = [m for m in conf.get("mounts") or () if mount_ends(m) not in
                       [(os.path.normpath(b), os.path.normpath(b)) for b in self.binds]]
        self.gpus = list(gpus)
        self.user = (os.getuid(), os.getgid()) if user is None else user
        self.name = container_name(tags)
        self.exe = "srun" if self.runtime == "pyxis" else self.runtime  # found on the client's PATH

    @property
    def daemon(self):
        return self.runtime in DAEMON_RUNTIMES

    def run_argv(self, command, env_file=None, name=None):
        """The client's argv that runs ``command`` in the image (through LOADER with ``env_file``)."""
        if command and command[0] == OWN_LAUNCHER:
            command = self.box_main("launchers.workers", env_file, command[1:])
        if env_file is not None:
            command = [self.python, "-S", "-c", LOADER, env_file, self.workdir] + list(command)
        build = {"apptainer": self.apptainer, "singularity": self.apptainer, "enroot": self.enroot,
                 "pyxis": self.pyxis}.get(self.runtime, self.daemon_run)
        return build(command, name or self.name)

    def box_main(self, module, env_file, args):
        """The command that runs ``module``.main(``args``) from the package beside ``env_file``."""
        return [self.python, "-S", "-c", BOX_MAIN % module, (env_file or "") + CODE_DIR] + list(args)

    def daemon_run(self, command, name):
        argv = [self.exe, "run", "--rm", "--name", name, "--pull=never", "--network=host", "--ipc=host"]
        argv += ["--label=%s=%s" % (label, self.tags[tag]) for tag, label in LABELS if tag in self.tags]
        argv.append("--label=%s=%d" % (UID_LABEL, os.getuid()))
        if self.runtime == "podman" and self.user[0] not in (0, "0"):
            argv.append("--userns=keep-id")  # rootless: the user's own uid inside, so files in the workdir stay theirs
        else:
            argv.append("--user=%s:%s" % self.user)
        if self.gpus:
            argv += (["--gpus", '"device=%s"' % ",".join(self.gpus)] if self.runtime == "docker" else
                     ["--device=nvidia.com/gpu=%s" % g for g in self.gpus])  # podman: CDI
        for path in self.binds:
            argv.append("--volume=%s:%s" % (path, path))
        argv += ["--volume=%s" % m for m in self.mounts]
        argv += ["--workdir=%s" % self.workdir] + self.options
        return argv + [self.image] + list(command)

    def apptainer(self, command, _name):
        # no network or IPC namespace unless asked: the host's, as NCCL needs
        argv = [self.exe, "exec", "--cleanenv", "--pwd", self.workdir]
        if self.gpus:
            argv.append("--nv")  # the host's driver; CUDA_VISIBLE_DEVICES (passed in the env file) picks
        for path in self.binds:
            argv += ["--bind", path]
        for m in self.mounts:
            argv += ["--bind", m]
        return argv + self.options + [self.image] + list(command)

    def enroot(self, command, _name):
        argv = [self.exe, "start"]
        for path in self.binds:
            argv += ["--mount", "%s:%s" % (path, path)]
        for m in self.mounts:
            argv += ["--mount", m]
        # enroot's NVIDIA hook reads these at start; they are not secrets
        argv += ["--env", "NVIDIA_VISIBLE_DEVICES=%s" % (",".join(self.gpus) or "void")]
        return argv + self.options + [self.image] + list(command)

    def pyxis(self, command, name):
        """A step of the node's own Slurm allocation, in pyxis's container: Slurm keeps its life."""
        mounts = ["%s:%s" % (p, p) for p in self.binds] + self.mounts
        argv = [self.exe, "--overlap", "--nodes=1", "--ntasks=1", "--nodelist=%s" % os.environ.get("SLURMD_NODENAME", os.uname()[1]),
                "--unbuffered", "--quiet", "--job-name=%s" % name, "--container-image=%s" % self.image,
                "--container-mounts=%s" % ",".join(mounts), "--container-workdir=%s" % self.workdir]
        return argv + self.options + list(command)

    def start_args(self, argv, env, base, own, env_file, code=None, warm=None):
        """(the client's argv, its environment) that start the launcher ``argv`` with the job's
        ``env`` (see inner_env) in ``env_file``; the client gets the agent's own ``base`` (the
        runtime's settings) and the tags. An earlier attempt's container is gone first.
        ``code``: the package the image runs (BOX_MAIN) for OWN_LAUNCHER, or with ``warm``, boxwarm's arguments."""
        write_env(env_file, inner_env(env, base, own, self.gpus))
        if argv[0] == OWN_LAUNCHER or warm is not None:
            write_package(env_file + CODE_DIR, code or {})
        if warm is not None:
            argv = self.box_main("launchers.boxwarm", env_file, list(warm) + ["--"] + list(argv))
        self.remove_earlier()
        return self.run_argv(argv, env_file), dict(base, **{k: env[k] for k in TAGS if k in env})

    # --- the container's life (daemon runtimes; a child runtime's container is its client process)

    def runtime_cmd(self, args, wait=COMMAND_WAIT):
        """(exit status, stdout, stderr) of ``runtime ARGS``, bounded; (None, "", why) if it could not run."""
        return run_bounded([self.exe] + args, wait)

    def signal(self, name):
        """``name`` (SIGTERM...) to the container's first process, the launcher; False if this
        runtime's container is not the daemon's (then the client process is signalled)."""
        if not self.daemon:
            return False
        self.runtime_cmd(["kill", "--signal=%s" % name, self.name])
        return True

    def remove(self):
        """Kill and remove this attempt's container, if it is still there."""
        if self.daemon:
            remove_named(self.exe, [self.name])

    def remove_earlier(self):
        """A restart never meets an earlier attempt's container: any of this job's on this node goes first."""
        if self.daemon:
            match = {TAG_JOB: self.tags[TAG_JOB], TAG_NODE: self.tags[TAG_NODE]}
            remove_named(self.exe, list_labelled(self.exe, match))


def run_bounded(argv, wait):
    """(exit status, stdout, stderr) of ``argv``, bounded by ``wait``; (None, "", why) if it could not run."""
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              timeout=wait)
    except (OSError, subprocess.SubprocessError) as e:
        return None, "", str(e)
    return done.returncode, done.stdout.decode("utf-8", "replace"), done.stderr.decode("utf-8", "replace")


def remove_named(exe, names):
    """``rm --force`` (SIGKILL, then removal) of the named containers; those that were there."""
    if not names:
        return []
    podman = os.path.basename(exe) == "podman"  # its --force stops with the image's timeout first, unless told
    run_bounded([exe, "rm", "--force"] + (["--time=0"] if podman else []) + list(names), COMMAND_WAIT)
    return names


def list_labelled(exe, match):
    """The names of the containers (running or not) whose labels carry ``match``'s tags."""
    out = run_bounded([exe, "ps", "--all", "--format", "{{.Names}}"] + label_filters(match), COMMAND_WAIT)[1]
    return [name for name in out.split() if name.startswith("ddp-up-")]


def sweep(runtimes, match, dry_run):
    """ddp-kill: this node's containers that carry ``match`` (by label), removed unless ``dry_run``."""
    found = []
    for runtime in runtimes or ():
        exe = shutil.which(runtime) if runtime in DAEMON_RUNTIMES else None
        if exe:
            names = list_labelled(exe, match)
            found += names if dry_run else remove_named(exe, names)
    return found


def write_env(path, env):
    """The job's environment for LOADER: 0600, never through a link or over another file."""
    write_private(path, json.dumps(env))


def write_package(where, code):
    """``where``/BOX_PACKAGE/ with ``code``'s modules (dotted names: a room is a folder), private,
    for BOX_MAIN."""
    package = os.path.join(where, BOX_PACKAGE)
    for path in (where, package):
        os.mkdir(path, 0o700)
    rooms = {name.rpartition(".")[0] for name in code} - {""}
    for room in sorted(rooms):
        if not room.isidentifier():
            raise ValueError("not a room's name: %r" % room)
        os.mkdir(os.path.join(package, room), 0o700)
    for name, text in dict(code, __init__="", **{room + ".__init__": "" for room in rooms}).items():
        parts = [os.path.basename(part) for part in name.split(".")]
        write_private(os.path.join(package, *parts) + ".py", text)


def inner_env(env, base, own, gpus):
    """What the container gets: every variable the job's environment sets or changes over the
    agent's own (``base``), and always those named in ``own`` (the cluster file's, the tags,
    ddp-up's), never the host's PATH or libraries. Behind devices passed by the runtime, GPUs
    count from 0 again."""
    inner = {k: v for k, v in env.items() if base.get(k) != v or k in own}
    if gpus:
        inner.pop("CUDA_VISIBLE_DEVICES", None)
    return inner


# --- preflight ----------------------------------------------------------------------------------


def mount_ends(mount):
    """(source, destination) of SRC[:DST[:OPTIONS]] (as the controller checked it), normalized."""
    parts = mount.split(":")
    return os.path.normpath(parts[0]), os.path.normpath(parts[1] if len(parts) > 1 and parts[1] else parts[0])
