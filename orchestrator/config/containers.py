"""``container:`` in the cluster file (top level, or a node's own; ``container: null`` on a node
runs it on the host): the image the job's launcher runs in, and how. The agent stays on the host
and keeps the container's life (node/launchers/container.py).

    container:
      image: nvcr.io/nvidia/pytorch:25.01-py3    # or just `container: IMAGE`
      runtime: docker            # podman, apptainer, singularity, enroot; pyxis (srun --container-image)
      pull: missing              # never, missing (the default), always
      mounts: [/data:/data:ro]   # SRC[:DST[:ro|rw]], on the node
      options: [--ulimit=memlock=-1]   # passed to the runtime's run/exec/start as they are
      python: python3            # the image's interpreter (the launcher's, and the versions' probe)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .. import node
from ..node.launchers.container import PROBE_WAIT, PULL_WAIT, PULLS, RUNTIMES

KEYS = ("image", "runtime", "pull", "mounts", "options", "python")
MOUNT_OPTIONS = ("ro", "rw")
# What ddp-up sets itself: the container's name, labels, life and its first process's streams.
OWN_OPTIONS = ("--name", "--rm", "-d", "--detach", "--label", "-l", "--label-file", "--init", "-i", "--interactive",
               "-t", "--tty")
OWN_SHORT = "dlit"  # the one-letter ones, also where bundled: -dt, -itd


@dataclass(frozen=True)
class ContainerConfig:
    image: str
    runtime: str = "docker"
    pull: str = "missing"
    mounts: tuple[str, ...] = ()
    options: tuple[str, ...] = ()
    python: str = "python3"

    def wire(self) -> dict:
        """As RunSpec.container carries it to the node (node/container.Box takes it)."""
        return {"runtime": self.runtime, "image": self.image, "pull": self.pull, "mounts": list(self.mounts),
                "options": list(self.options), "python": self.python}


# What a container's first process runs in the image (container.BOX_MAIN), by its name there: the
# node module, with every module of the node's it imports (node.needs), stdlib only
BOX_MODULES = {"workers": "launchers.workers", "boxwarm": "launchers.boxwarm", "boxkeep": "launchers.boxkeep"}


def box_code(main: str) -> dict[str, str]:
    """The sources of ``main``'s modules (BOX_MODULES), as RunSpec.box_code carries them: `launcher:
    none`'s workers started cold, warm start's launcher (under torchrun or `launcher: none`), or
    the first process of a warm container kept across launches (KeepSpec.box_code)."""
    return {name: node.source(name).decode("utf-8") for name in node.needs(BOX_MODULES[main])}


def preflight_allowance(config: ContainerConfig | None) -> float:
    """Seconds a node's preflight may take on top of the host's: the versions read in a container
    of the image, and its pull (a connected agent that dies is seen at once all the same)."""
    if config is None:
        return 0.0
    return PROBE_WAIT + (PULL_WAIT if config.pull != "never" else 0.0)


def container(value: Any, transport: str, error: Callable[[tuple, str], Exception]) -> ContainerConfig | None:
    """The checked `container:` of a node (None: none); ``error(at, why)`` makes the ConfigError."""
    if value is None:
        return None
    if isinstance(value, str):
        value = {"image": value}
    if not isinstance(value, dict):
        raise error((), "must be an image name, or a mapping with `image:` (and runtime, pull, mounts, options, python)")
    unknown = [k for k in value if k not in KEYS]
    if unknown:
        raise error((unknown[0],), f"unknown key; allowed here: {', '.join(KEYS)}")
    for key in ("image", "python"):
        if key in value and (not isinstance(value[key], str) or not value[key].strip() or value[key] != value[key].strip()):
            raise error((key,), "must be a non-empty string without surrounding spaces")
    if "image" not in value:
        raise error((), "missing `image:` (e.g. nvcr.io/nvidia/pytorch:25.01-py3, or an image file's path on the nodes)")
    if value["image"].startswith("-"):
        raise error(("image",), "must be an image's name or path, not an option (it starts with -)")
    runtime = _choice(value, "runtime", RUNTIMES, "docker", error)
    if runtime == "pyxis" and transport != "srun":
        raise error(("runtime",), "pyxis is Slurm's: use it under --slurm (transport: srun), or `runtime: enroot`")
    return ContainerConfig(image=value["image"], runtime=runtime, pull=_choice(value, "pull", PULLS, "missing", error),
                           mounts=_mounts(value.get("mounts", []), error),
                           options=_options(value.get("options", []), error), python=value.get("python", "python3"))


def _choice(value: dict, key: str, allowed: tuple[str, ...], default: str, error) -> str:
    chosen = value.get(key, default)
    if chosen not in allowed:
        raise error((key,), f"must be one of {', '.join(allowed)}, got {chosen!r}")
    return chosen


def _mounts(value: Any, error) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise error(("mounts",), "must be a list of SRC[:DST[:ro|rw]], e.g. [/data:/data:ro]")
    for i, mount in enumerate(value):
        parts = mount.split(":") if isinstance(mount, str) else []
        paths = parts[:2]
        if not 1 <= len(parts) <= 3 or not all(p.startswith("/") for p in paths) or \
                (len(parts) == 3 and parts[2] not in MOUNT_OPTIONS) or "," in mount:
            raise error(("mounts", i), "must be SRC[:DST[:ro|rw]] with absolute paths on the node and inside "
                                       "the image, e.g. /data:/data:ro")
    return tuple(value)


def _options(value: Any, error) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(o, str) and o for o in value):
        raise error(("options",), "must be a list of the runtime's options, e.g. [--ulimit=memlock=-1]")
    for i, option in enumerate(value):
        name = option.split("=", 1)[0]
        bundled = name[:1] == "-" and name[1:2] != "-" and name[1:].isalpha() and any(c in OWN_SHORT for c in name[1:])
        if name in OWN_OPTIONS or bundled:
            raise error(("options", i), f"{name} is ddp-up's own: it names, labels, starts and removes every "
                                        "container itself")
    return tuple(value)
