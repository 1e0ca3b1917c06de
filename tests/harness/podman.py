"""Real container runtimes for the tests, each with a store of its own and a local image: podman,
and Debian's docker.io daemon, started for the session on a private socket.

Facts measured on these machines (see issue 30): podman runs containers here with runc and the
cgroupfs manager, and a containers.conf that sets no default ulimits (the sandbox cannot raise
rlimits; crun refuses the hybrid cgroup layout). No registry is reachable, so the image is
imported from an empty root filesystem, and the test's Python (with torch) is bind-mounted into it
read-only. Everything podman keeps (images, containers, run state) is under one directory that the
session removes.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

IMAGE = "localhost/ddp-up-test:1"
# What the image does not hold, from the host, read-only: the dynamic loader and libraries,
# and the test's Python with torch in it.
HOST_MOUNTS = tuple(d for d in ("/usr", "/lib", "/lib64", "/bin", "/etc/alternatives") if os.path.exists(d))


def available() -> str | None:
    """None, or why podman cannot run containers here."""
    if not shutil.which("podman") or not shutil.which("runc"):
        return "needs podman and runc (apt-get install podman runc)"
    return None


DOCKERD = "/usr/sbin/dockerd"


def docker_available() -> str | None:
    """None, or why Debian's docker daemon cannot be started here."""
    if not os.path.exists(DOCKERD) or not shutil.which("docker") or not shutil.which("runc"):
        return "needs docker.io (apt-get install docker.io)"
    return None


def tmp_env(tmpdir: Path | None) -> dict:
    return {"TMPDIR": str(tmpdir)} if tmpdir is not None else {}


def python_roots() -> list[str]:
    """The directories that hold this Python and its packages: its base, and a venv's own (the
    README's test command may run in one, with torch installed there)."""
    roots = [os.path.realpath(sys.base_prefix)]
    venv = os.path.realpath(sys.prefix)
    return roots + ([venv] if not venv.startswith(roots[0] + os.sep) and venv != roots[0] else [])


class Podman:
    runtime = "podman"

    def __init__(self, root: Path, tmpdir: Path | None = None):
        """``tmpdir``: the TMPDIR of the ddp-up runs given ``env`` (their agents' state root goes there)."""
        self.root = root
        self.env = {"CONTAINERS_CONF": str(root / "containers.conf"),
                    "CONTAINERS_STORAGE_CONF": str(root / "storage.conf"), **tmp_env(tmpdir)}

    def up(self) -> "Podman":
        (self.root / "containers.conf").write_text(
            '[containers]\ndefault_ulimits = []\n[engine]\nruntime = "runc"\ncgroup_manager = "cgroupfs"\n'
            'events_logger = "none"\n')
        (self.root / "storage.conf").write_text(
            f'[storage]\ndriver = "vfs"\ngraphroot = "{self.root / "graph"}"\nrunroot = "{self.root / "run"}"\n')
        self.podman("import", "-", IMAGE, input=empty_rootfs())
        return self

    def podman(self, *args: str, input: bytes | None = None, check: bool = True) -> str:
        done = subprocess.run([self.runtime, *args], input=input, capture_output=True, timeout=120,
                              env={**os.environ, **self.env})
        if check and done.returncode:
            raise RuntimeError(f"{self.runtime} {' '.join(args)}: {done.stderr.decode(errors='replace')}")
        return done.stdout.decode(errors="replace")

    def containers(self, job: str | None = None) -> list[str]:
        """Every container in the store (of ``job``, by its label), running or not."""
        label = ["--filter", f"label=ddp-up.job={job}"] if job else []
        return self.podman("ps", "--all", "--format", "{{.Names}}", *label).split()

    def config(self, **more) -> dict:
        """A cluster file's `container:` for the test image."""
        mounts = [f"{d}:{d}:ro" for d in (*HOST_MOUNTS, *python_roots())]
        return {"runtime": self.runtime, "image": IMAGE, "pull": "never", "python": sys.executable,
                "mounts": mounts, **more}

    def down(self) -> None:
        self.podman("rm", "--all", "--force", "--time=0", check=False)
        self.podman("rmi", "--all", "--force", check=False)
        shutil.rmtree(self.root, ignore_errors=True)


class Docker(Podman):
    """The docker.io daemon, with its store, socket and run state under ``root`` (no bridge, no
    iptables: the tests' containers use the host's network), for the session."""

    runtime = "docker"

    def __init__(self, root: Path, tmpdir: Path | None = None):
        super().__init__(root)
        self.socket = root / "docker.sock"
        self.env = {"DOCKER_HOST": f"unix://{self.socket}", **tmp_env(tmpdir)}
        self.daemon: subprocess.Popen | None = None

    def up(self) -> "Docker":
        config = {"storage-driver": "vfs", "iptables": False, "ip6tables": False, "bridge": "none",
                  "data-root": str(self.root / "data"), "exec-root": str(self.root / "exec"),
                  "pidfile": str(self.root / "docker.pid"), "hosts": [self.env["DOCKER_HOST"]]}
        (self.root / "daemon.json").write_text(json.dumps(config))
        self.daemon = subprocess.Popen([DOCKERD, "--config-file", str(self.root / "daemon.json")],
                                       stdout=subprocess.DEVNULL, stderr=open(self.root / "dockerd.log", "wb"))
        deadline = time.monotonic() + 30
        while subprocess.run(["docker", "info"], capture_output=True, env={**os.environ, **self.env},
                             timeout=30).returncode and time.monotonic() < deadline:
            if self.daemon.poll() is not None:
                raise RuntimeError((self.root / "dockerd.log").read_text()[-2000:])
            time.sleep(0.1)
        self.podman("import", "-", IMAGE, input=empty_rootfs())
        return self

    def down(self) -> None:
        ids = self.podman("ps", "--all", "--quiet", check=False).split()
        if ids:
            self.podman("rm", "--force", *ids, check=False)
        if self.daemon is not None:
            self.daemon.terminate()
            try:
                self.daemon.wait(30)
            except subprocess.TimeoutExpired:
                self.daemon.kill()
                self.daemon.wait(10)
        unmount_below(self.root)  # dockerd leaves its network namespace's mount (exec-root/netns/default)
        shutil.rmtree(self.root, ignore_errors=True)


def unmount_below(root: Path) -> None:
    """Every mount under ``root``, deepest first."""
    with open("/proc/mounts") as f:
        points = [line.split()[1] for line in f if line.split()[1].startswith(f"{root}/")]
    for point in sorted(points, key=len, reverse=True):
        subprocess.run(["umount", point], capture_output=True, timeout=30)


def empty_rootfs() -> bytes:
    """A tar of a root filesystem with nothing but the directories a container needs."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, mode in (("tmp", 0o1777), ("etc", 0o755), ("proc", 0o555), ("sys", 0o555), ("dev", 0o755),
                           ("root", 0o700), ("run", 0o755), ("var", 0o755)):
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, mode
            tar.addfile(info)
        passwd = b"root:x:0:0:root:/root:/bin/sh\n"
        info = tarfile.TarInfo("etc/passwd")
        info.size = len(passwd)
        tar.addfile(info, io.BytesIO(passwd))
    return out.getvalue()
