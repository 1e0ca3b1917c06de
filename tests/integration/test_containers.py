"""Issue 30: the job's launcher in a real container (podman; Debian's docker daemon for the runtime's
own paths: its run line, inspect, the label sweep), and no container outlives its job.

The nodes are `transport: local` (the same agent and controller as over SSH), but for one job
over SSH to two of the sshd cluster's nodes, whose second sshd is entered with `nsenter --net`
(podman inside a network namespace needs the host's mounts, which `ip netns exec` replaces). The image
is imported locally and bind-mounts the test's Python read-only (tests/harness/podman.py).
Every test ends with zero containers in the store and zero tagged processes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from tests.harness import procs
from tests.harness.exclusive import one_worker_at_a_time
from tests.harness.podman import Docker, Podman, available, docker_available
from tests.harness.runner import CHECK, KILL, Launch

BOXED = str(Path(__file__).resolve().parents[1] / "scripts" / "boxed.py")
REPO = Path(__file__).resolve().parents[2]
TOKEN = "s3cr3t-value-42"
pytestmark = [pytest.mark.skipif(available() is not None, reason=available() or ""),
              pytest.mark.xdist_group("containers")]  # one worker's: the runtimes are set up once, per module


@pytest.fixture(scope="module")
def podman(tmp_path_factory, state_tmp):
    p = Podman(tmp_path_factory.mktemp("podman"), state_tmp).up()
    try:
        yield p
    finally:
        p.down()


@pytest.fixture(scope="module")
def state_tmp(tmp_path_factory):
    """The agents' TMPDIR, so their state root (and the versions kept there per image) goes with the module.

    Every runtime fixture takes it, so its lock keeps the daemons on one worker at a time."""
    with one_worker_at_a_time(tmp_path_factory, "containers"):
        yield tmp_path_factory.mktemp("tmp")


@pytest.fixture(scope="module")
def docker(tmp_path_factory, state_tmp):
    if docker_available():
        pytest.skip(docker_available())
    d = Docker(tmp_path_factory.mktemp("docker"), state_tmp).up()
    try:
        yield d
    finally:
        d.down()


@pytest.fixture(params=["podman", "docker"])
def runtime(request):
    """Each runtime the tests run: podman, and Debian's docker daemon."""
    return request.getfixturevalue(request.param)


@pytest.fixture
def boxed(podman, tmp_path):
    """(a cluster file of `gpus` per node in containers, more top-level keys), then no container or process left."""
    used = [podman]

    def make(gpus=(2, 1), container=None, runtime=podman, **top) -> Path:
        used.append(runtime)
        data = {"transport": "local", "python": sys.executable, "workdir": str(tmp_path), "orphan_timeout": 5,
                "stop_grace": 3, "env": {"OMP_NUM_THREADS": 1, "BOX_TOKEN": TOKEN},
                "nodes": [{"host": f"box-{i}", "gpus": g} for i, g in enumerate(gpus)],
                "container": container or runtime.config(), **top}
        path = tmp_path / "cluster.yaml"
        path.write_text(yaml.safe_dump(data))
        shutil.copy(BOXED, tmp_path / "boxed.py")  # in the workdir: the one host directory the container sees
        return path

    yield make
    for store in set(used):
        assert procs.wait_for(lambda: not store.containers(), timeout=20, interval=0.2), \
            f"{store.runtime}: containers left: {store.containers()}"
    assert not procs.wait_no_job_processes(None, timeout=15)


def up(runtime, path, mode, *more) -> Launch:
    return Launch(["--no-dashboard", *more, str(path), "boxed.py", str(path.parent), mode],
                  env=runtime.env)


def wait_ready(launch: Launch, path: Path, ranks: int) -> None:
    def started():
        return len(list(path.parent.glob("ready.0.*"))) == ranks or launch.proc.poll() is not None

    # bounded, not slept: it returns as every rank starts. 120 s: under the whole suite's load (four
    # workers on two cores), an image's start and torch's import in it once took longer than 60 s
    assert procs.wait_for(started, timeout=120) and launch.proc.poll() is None, \
        f"not every rank started: {sorted(p.name for p in path.parent.glob('ready.*'))}\n{launch.output}"


def test_a_job_runs_in_named_containers_with_its_secret_in_no_command_line_or_config(runtime, boxed):
    path = boxed(runtime=runtime)
    launch = up(runtime, path, "wait")
    wait_ready(launch, path, 3)
    job = launch.job_id
    names = runtime.containers(job)
    assert sorted(names) == [f"ddp-up-{job}-n0-a0", f"ddp-up-{job}-n1-a0"]
    inspected = runtime.podman("inspect", *names)
    labels = [c["Config"]["Labels"] for c in json.loads(inspected)]
    assert {(lab["ddp-up.job"], lab["ddp-up.node"], lab["ddp-up.attempt"]) for lab in labels} == {(job, "0", "0"),
                                                                                                (job, "1", "0")}
    assert TOKEN not in inspected
    assert procs.secret_in_cmdlines(TOKEN) == []
    (path.parent / "go").touch()
    assert launch.wait(60) == 0, launch.output
    out = launch.output
    for rank in range(3):
        assert f"rank {rank} token ok uid 0 in {path.parent} (a container)" in out
        assert f"rank {rank} warm True attempt 0" in out  # torchrun's default: forked from the image's warm interpreter
        assert f"rank {rank} sum 6" in out
    assert "warm start" not in out  # no notice: nothing fell back to a cold start
    assert TOKEN not in out


def test_a_restart_forks_from_the_container_kept_from_the_first_attempt(podman, boxed):
    """A run that restarts keeps one warm container a node (node/launchers/keptbox.py): both attempts' ranks
    are forked from the interpreter that imported torch before the first, in no new container."""
    path = boxed(gpus=(1, 1), restarts=1, restart_delay=0)
    launch = up(podman, path, "retry")
    assert launch.wait(90) == 0, launch.output
    assert "rank 1 sum 3" in launch.output
    assert len(list(path.parent.glob("ready.1.*"))) == 2
    for attempt in (0, 1):
        assert [f"rank {r} warm True attempt {attempt}" in launch.output for r in (0, 1)] == [True, True], launch.output
    assert_forked_from_one_interpreter(path.parent, ranks=2)
    assert "warm start" not in launch.output  # no notice: nothing fell back


def assert_forked_from_one_interpreter(where: Path, ranks: int) -> None:
    """Each rank's attempts 0 and 1 were forked from one warm interpreter (boxed.py's ready files)."""
    started = {(a, r): (where / f"ready.{a}.{r}").read_text() for a in (0, 1) for r in range(ranks)}
    assert all(started[0, r] == started[1, r] != "cold" for r in range(ranks)), started


def test_a_detached_restart_forks_from_the_container_its_agent_kept(podman, boxed):
    """Detached, each node's agent runs every attempt, and keeps the warm container for them; it
    goes with the job's end (the fixture checks). Under docker: the ddp-kill test below."""
    path = boxed(gpus=(1, 1), restarts=1, restart_delay=0)
    launch = up(podman, path, "retry", "--detach")
    assert launch.wait(60) == 0, launch.output
    assert procs.wait_for(lambda: len(list(path.parent.glob("ready.1.*"))) == 2, timeout=90), launch.output
    assert_forked_from_one_interpreter(path.parent, ranks=2)


# A Python session: two launches of a function, each rank answering with the start of the
# interpreter it was forked from (its parent's start: a new container's is new).
SESSION = """
import json, sys
from orchestrator import launch

def interpreter():
    import os
    with open("/proc/%d/stat" % os.getppid()) as f:
        return f.read().rsplit(")", 1)[1].split()[19]

for _ in range(2):
    print(json.dumps(launch(sys.argv[1], interpreter, runs_dir=sys.argv[2]).results), flush=True)
"""


def test_a_second_launch_from_python_forks_from_the_container_the_first_kept(podman, boxed, tmp_path):
    """The session keeps one warm container a node; it goes with the session (the fixture checks)."""
    path = boxed(gpus=(1, 1))
    done = subprocess.run([sys.executable, "-c", SESSION, str(path), str(tmp_path / "runs")], cwd=REPO,
                          env=dict(os.environ, **podman.env), capture_output=True, text=True, timeout=180)
    said = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and len(said) == 2, done.stdout + done.stderr
    first, second = said
    assert len(first) == 2 and first == second, said  # each rank: the same interpreter both times


def test_warm_false_in_a_container_is_the_cold_start(podman, boxed):
    path = boxed(gpus=(1,), warm=False)
    launch = up(podman, path, "retry")  # attempt 0 of rank 0 fails with exit 3: no restart asked for
    assert launch.wait(90) == 1, launch.output
    assert "rank 0 warm False attempt 0" in launch.output and "rank 0 exited with code 3" in launch.output, launch.output


def test_ddp_check_collective_runs_its_probe_warm_in_the_image(podman, boxed):
    """The probe is ddp-up's own module, shipped in the hooks: torchrun and the probe are forked from
    the image's warm interpreter, which finds it on the rank's path as a script's rank would."""
    path = boxed(gpus=(2, 1))
    check = Launch([str(path), "--collective"], code=CHECK, env=podman.env)
    assert check.wait(120) == 0, check.output
    assert "all_reduce across 2 nodes (gloo)" in check.output and "each node's link" in check.output, check.output
    assert "the probe forked from a warm interpreter on 2 of 2 nodes" in check.output, check.output
    assert "warm start" not in check.output  # no notice: nothing fell back to a cold start


@pytest.mark.parametrize("launcher", ["torchrun", "none"])
def test_a_failed_rank_stops_every_container_and_a_rank_past_its_grace_is_killed(podman, boxed, launcher):
    path = boxed(stop_grace=1, launcher=launcher, warm=True)  # `launcher: none` is warm where asked
    launch = up(podman, path, "stubborn")
    assert launch.wait(90) == 1, launch.output  # three containers' torch imports, on a loaded 2-core machine: 50 s seen
    assert "exit code 7" in launch.output or "exitcode  : 7" in launch.output, launch.output


@pytest.mark.parametrize("launcher,restarts", [("torchrun", 0), ("none", 1)], ids=["torchrun", "none-kept"])
def test_ctrl_c_gives_every_rank_its_grace_and_removes_the_containers(podman, boxed, launcher, restarts):
    """restarts: 1 runs the attempt in the kept container (node/launchers/keptbox.py): the stop reaches the
    ranks through it, and it goes with the run."""
    path = boxed(launcher=launcher, warm=True, restarts=restarts)
    launch = up(podman, path, "hold")
    wait_ready(launch, path, 3)
    launch.signal(signal.SIGINT)
    assert launch.wait(60) == 130, launch.output
    for rank in range(3):
        assert f"rank {rank} saved on SIGTERM" in launch.output
        assert f"rank {rank} warm True attempt 0" in launch.output  # forked from the image's warm interpreter


def test_the_controller_killed_its_agents_remove_the_containers(podman, boxed):
    """With restarts, the attempt runs in each node's kept container (node/launchers/keptbox.py): its keeper's
    connection, closed by the kernel, ends it too."""
    path = boxed(gpus=(1, 1), launcher="none", warm=True, restarts=1)
    launch = up(podman, path, "hold")
    wait_ready(launch, path, 2)
    job = launch.job_id
    launch.signal(signal.SIGKILL)
    launch.wait(10)
    gone = procs.wait_for(lambda: not podman.containers(job), timeout=30, interval=0.2)
    assert gone, f"containers left: {podman.containers(job)}"


@pytest.mark.parametrize("runtime,kept", [("podman", False), ("docker", True)], indirect=["runtime"],
                         ids=["podman-cold", "docker-kept"])
def test_ddp_kill_removes_a_detached_jobs_containers(runtime, boxed, kept):
    """Each runtime, one kind: `launcher: none`'s default (cold, ddp-up's workers in each
    attempt's container), or warm with restarts (each node's agent keeps one: node/launchers/keptbox.py)."""
    more = {"warm": True, "restarts": 1} if kept else {}
    path = boxed(gpus=(1, 1), runtime=runtime, launcher="none", **more)
    launch = up(runtime, path, "hold", "--detach")
    assert launch.wait(60) == 0, launch.output
    assert procs.wait_for(lambda: len(list(path.parent.glob("ready.0.*"))) == 2, timeout=60), launch.output
    job = launch.job_id
    names = runtime.containers(job)
    assert len(names) == 2 and all(n.startswith("ddp-up-keep-") == kept for n in names), names
    kill = Launch([str(path), "--job", job, "--purge"], code=KILL, env=runtime.env)
    assert kill.wait(60) == 0, kill.output
    assert not runtime.containers(job), kill.output


def test_a_missing_image_or_mount_is_named_before_anything_starts(podman, boxed):
    path = boxed(gpus=(1,), container=podman.config(image="localhost/no-such-image:1"))
    launch = up(podman, path, "wait")
    assert launch.wait(60) == 3, launch.output
    assert "box-0" in launch.output and "localhost/no-such-image:1 is not on this node" in launch.output
    path = boxed(gpus=(1,), container=podman.config(mounts=["/no/such/dir:/data"]))
    launch = up(podman, path, "wait")
    assert launch.wait(60) == 3, launch.output
    assert "container.mounts[0]: /no/such/dir does not exist" in launch.output
    assert "Traceback" not in launch.output


SSH_PORT = 2200  # the second sshd of the nodes that can run containers


@pytest.fixture(scope="module")
def boxable(cluster):
    """Two of the sshd cluster's nodes with an sshd that keeps the host's mounts (once per session)."""
    nodes = cluster.nodes[2:4]
    for node in nodes:
        if not any(f"-{SSH_PORT}.pid" in p.name for p in cluster.run_dir.glob(f"{node.name}-*.pid")):
            cluster.start_sshd(node, f"{node.addr}:{SSH_PORT}", host_mounts=True)
    return nodes


def test_a_job_over_ssh_runs_in_containers_in_each_nodes_network(cluster, boxable, podman, tmp_path):
    shutil.copy(BOXED, tmp_path / "boxed.py")
    (tmp_path / "go").touch()
    setup = [f"export {k}={v}" for k, v in podman.env.items() if k != "TMPDIR"]  # the test store, on the node
    path = cluster.cluster_file(tmp_path / "cluster.yaml", [(n, 1) for n in boxable], ssh={"port": SSH_PORT},
                                python=sys.executable, workdir=str(tmp_path), setup=setup, stop_grace=3,
                                env={"OMP_NUM_THREADS": 1, "BOX_TOKEN": TOKEN}, container=podman.config())
    state = Path(tempfile.gettempdir()) / f"ddp-up-{os.getuid()}"
    kept = set(state.glob(".versions-*"))
    try:
        launch = Launch(["--no-dashboard", str(path), "boxed.py", str(tmp_path), "wait"])
        assert launch.wait(90) == 0, launch.output
    finally:
        for path in set(state.glob(".versions-*")) - kept:  # this store's image: gone with it
            path.unlink()
    for rank, node in enumerate(boxable):
        assert f"rank {rank} token ok uid 0 in {tmp_path} (a container)" in launch.output
        assert f"rank {rank} sum 3" in launch.output
    assert "GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME set to the interface that reaches the master: eth0" in \
        launch.output, launch.output
    assert not podman.containers()
