"""Issue 30: `container:` as the cluster file gives it, and each runtime's command lines as the
node's agent builds them (docker, apptainer, singularity, enroot and pyxis are not installed on
these machines: their command lines are checked here only)."""

import os
import re
import textwrap
import time
from pathlib import Path

import pytest

from orchestrator.config.clusterfile import parse_cluster
from orchestrator.errors import ConfigError
from orchestrator.node.launchers import container, image
from orchestrator.node.launchers.container import LOADER, Box, inner_env, label_filters
from orchestrator.node.attempt.placement import warm_in_box
from orchestrator.node.local.procs import JOB_SIGNALS
from orchestrator.plan.launch import make_plan

TAGS = {"DDP_UP_JOB": "j1", "DDP_UP_NODE": "1", "DDP_UP_ATTEMPT": "2", "DDP_UP_CLUSTER": "c", "DDP_UP_RUN": "r"}
CONF = {"runtime": "docker", "image": "nvcr.io/nvidia/pytorch:25.01-py3", "mounts": ["/data:/data:ro"],
        "options": ["--ulimit=memlock=-1"], "python": "python3", "pull": "missing"}


def parse(text):
    return parse_cluster(textwrap.dedent(text), "c.yaml")


def test_a_top_level_container_applies_to_every_node_and_a_node_may_have_its_own_or_none():
    cfg = parse("""\
        container: {image: img:1, runtime: podman, mounts: [/data:/data:ro], options: [--shm-size=8g]}
        nodes:
          - {host: a, gpus: 1}
          - {host: b, gpus: 1, container: other:2}
          - {host: c, gpus: 1, container: null}
        """)
    a, b, c = (n.container for n in cfg.nodes)
    assert (a.image, a.runtime, a.pull, a.mounts, a.options, a.python) == (
        "img:1", "podman", "missing", ("/data:/data:ro",), ("--shm-size=8g",), "python3")
    assert (b.image, b.runtime) == ("other:2", "docker")
    assert c is None


@pytest.mark.parametrize("text, key, words", [
    ("{image: i, runtime: lxc}", "container.runtime", "must be one of docker, podman"),
    ("{image: i, pull: sometimes}", "container.pull", "never, missing, always"),
    ("{runtime: docker}", "container", "missing `image:`"),
    ("{image: i, mounts: [data:/data]}", "container.mounts[0]", "absolute paths"),
    ("{image: i, mounts: ['/a:/b:rx']}", "container.mounts[0]", "SRC[:DST[:ro|rw]]"),
    ("{image: i, options: [--name=x]}", "container.options[0]", "ddp-up's own"),
    ("{image: i, imag: j}", "container.imag", "unknown key"),
    ("{image: i, runtime: pyxis}", "container.runtime", "under --slurm"),
    ("[i]", "container", "must be an image name"),
])
def test_a_bad_container_names_its_key_and_line(text, key, words):
    with pytest.raises(ConfigError) as e:
        parse(f"""\
            nodes:
              - host: a
                gpus: 1
                container: {text}
            """)
    message = str(e.value)
    assert f"c.yaml:4: nodes[0].{key}" in message and words in message, message


def test_launcher_none_with_warm_start_runs_boxwarm_which_passes_every_job_signal_on(tmp_path):
    """`warm: true` under `launcher: none` in a container: the first process is boxwarm, with the
    Go's own launcher line after its arguments, and it passes on every signal workers.main would."""
    cfg = parse("launcher: none\nwarm: true\nstop_signal: SIGINT\ncontainer: img\nnodes: [{host: a, gpus: 2}]\n")
    plan = make_plan(cfg, "t.py", [], "j1", str(tmp_path))
    spec = plan.agent_spec(plan.nodes[0])
    assert spec.warm and set(spec.box_code) == {"local.procs", "launchers.workers", "launchers.warm", "launchers.boxwarm", "local.ourcode",
                                              "protocol.policy",
                                              "userpython.names", "userpython.proctitle", "userpython.beforefork",
                                              "userpython.inchild", "userpython.warmparent", "userpython.standin"}
    go = plan.launcher_argv(plan.nodes[0], 29500)
    warm = warm_in_box(spec, "/s", 1, go)
    assert warm == ["/s/warm.1.sock", "/s/warm.1.log", "", ",".join(JOB_SIGNALS), "2", "/s/hooks.1"]
    box = Box(CONF, TAGS, "/work")
    argv, _ = box.start_args(go, {}, {}, set(), str(tmp_path / "env.json"), spec.box_code, warm)
    inner = argv[argv.index(CONF["image"]) + 1:]
    assert inner[9:] == [container.BOX_MAIN % "launchers.boxwarm", str(tmp_path / "env.json.code"), *warm, "--", *go]
    assert warm_in_box(spec, "/s", 1, ["accelerate", "launch", "t.py"]) is None  # not a launcher it forks


def test_launcher_none_runs_its_own_launcher_in_the_image_from_the_sources_sent(tmp_path):
    cfg = parse("launcher: none\ncontainer: img\nnodes: [{host: a, gpus: 2}]\n")
    plan = make_plan(cfg, "t.py", [], "j1", str(tmp_path))
    code = plan.agent_spec(plan.nodes[0]).box_code
    assert set(code) == {"local.procs", "launchers.workers", "userpython.names"} and "def main(argv)" in code["launchers.workers"]
    box = Box(CONF, TAGS, "/work")
    argv = box.run_argv(plan.launcher_argv(plan.nodes[0], 29500), "/s/env.json")
    inner = argv[argv.index(CONF["image"]) + 1:]
    assert inner[6:11] == ["python3", "-S", "-c", container.BOX_MAIN % "launchers.workers", "/s/env.json.code"]
    assert inner[11:] == ["--nproc-per-node=2", "--node-rank=0", "--first-rank=0", "--world-size=2",
                          "--master-addr=a", "--master-port=29500", "t.py"]
    container.write_package(str(tmp_path / "code"), code)
    package = tmp_path / "code" / "ddp_up_box"
    assert sorted(str(p.relative_to(package)) for p in package.rglob("*.py")) == [
        "__init__.py", "launchers/__init__.py", "launchers/workers.py", "local/__init__.py", "local/procs.py",
        "userpython/__init__.py", "userpython/names.py"]


def test_docker_runs_named_labelled_on_the_host_network_with_the_gpus_and_no_value_on_its_command_line():
    box = Box(CONF, TAGS, "/work", binds=("/tmp/state",), gpus=["0", "1"], user=(1000, 1000))
    argv = box.run_argv(["python3", "-m", "torch.distributed.run", "t.py"], "/tmp/state/env.json")
    assert argv[:4] == ["docker", "run", "--rm", "--name"] and argv[4] == "ddp-up-j1-n1-a2"
    for arg in ("--network=host", "--ipc=host", "--pull=never", "--user=1000:1000", "--label=ddp-up.job=j1",
                "--label=ddp-up.node=1", "--label=ddp-up.attempt=2", "--volume=/work:/work",
                "--volume=/tmp/state:/tmp/state", "--volume=/data:/data:ro", "--workdir=/work", "--ulimit=memlock=-1"):
        assert arg in argv
    assert argv[argv.index("--gpus") + 1] == '"device=0,1"'
    image = argv.index(CONF["image"])
    assert argv[image + 1:] == ["python3", "-S", "-c", LOADER, "/tmp/state/env.json", "/work",
                                "python3", "-m", "torch.distributed.run", "t.py"]
    assert not any(a.startswith(("-e", "--env")) for a in argv)


def test_podman_passes_gpus_as_cdi_devices_and_keeps_a_rootless_users_uid():
    box = Box(dict(CONF, runtime="podman"), TAGS, "/work", gpus=["0", "GPU-1a2b"], user=(1000, 1000))
    argv = box.run_argv(["true"])
    assert "--device=nvidia.com/gpu=0" in argv and "--device=nvidia.com/gpu=GPU-1a2b" in argv
    assert "--userns=keep-id" in argv and not any(a.startswith("--user=") for a in argv)
    assert "--user=0:0" in Box(dict(CONF, runtime="podman"), TAGS, "/work", user=(0, 0)).run_argv(["true"])


@pytest.mark.parametrize("runtime", ["apptainer", "singularity"])
def test_apptainer_binds_the_workdir_uses_the_hosts_gpus_and_a_clean_environment(runtime):
    box = Box(dict(CONF, runtime=runtime, image="/images/pt.sif"), TAGS, "/work", binds=("/s",), gpus=["0"])
    argv = box.run_argv(["python3", "t.py"], "/s/env.json")
    assert argv[:5] == [runtime, "exec", "--cleanenv", "--pwd", "/work"]
    assert "--nv" in argv and argv[argv.index("/images/pt.sif") - 1] == "--ulimit=memlock=-1"
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--bind"] == ["/work", "/s", "/data:/data:ro"]
    assert argv[argv.index("/images/pt.sif") + 1:][:4] == ["python3", "-S", "-c", LOADER]


def test_enroot_mounts_and_names_its_gpus_for_the_nvidia_hook():
    argv = Box(dict(CONF, runtime="enroot", image="pytorch"), TAGS, "/work", gpus=["2", "3"]).run_argv(["python3"])
    assert argv[:2] == ["enroot", "start"]
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--mount"] == ["/work:/work", "/data:/data:ro"]
    assert argv[argv.index("--env") + 1] == "NVIDIA_VISIBLE_DEVICES=2,3"
    cpu = Box(dict(CONF, runtime="enroot", image="pytorch"), TAGS, "/work").run_argv(["python3"])
    assert cpu[cpu.index("--env") + 1] == "NVIDIA_VISIBLE_DEVICES=void"


def test_pyxis_is_a_step_of_the_allocation_on_this_node(monkeypatch):
    monkeypatch.setenv("SLURMD_NODENAME", "gpu-07")
    argv = Box(dict(CONF, runtime="pyxis"), TAGS, "/work", binds=("/s",)).run_argv(["python3", "t.py"])
    assert argv[:3] == ["srun", "--overlap", "--nodes=1"]
    for arg in ("--nodelist=gpu-07", "--container-image=nvcr.io/nvidia/pytorch:25.01-py3",
                "--container-mounts=/work:/work,/s:/s,/data:/data:ro", "--container-workdir=/work",
                "--job-name=ddp-up-j1-n1-a2"):
        assert arg in argv
    assert argv[-2:] == ["python3", "t.py"]


def test_the_container_gets_the_jobs_variables_not_the_hosts_and_its_gpus_count_from_zero():
    base = {"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/opt/x", "A": "same", "TMPDIR": "/tmp"}
    env = dict(base, A="same", B="new", PATH="/usr/bin", CUDA_VISIBLE_DEVICES="2,3", DDP_UP_JOB="j1")
    assert inner_env(env, base, {"A", "DDP_UP_JOB"}, gpus=["2", "3"]) == {"A": "same", "B": "new", "DDP_UP_JOB": "j1"}
    assert inner_env(env, base, set(), gpus=[])["CUDA_VISIBLE_DEVICES"] == "2,3"


def test_containers_are_found_by_the_labels_of_the_tags_given():
    mine = ["--filter", f"label=ddp-up.uid={os.getuid()}"]  # a shared docker daemon: this user's alone
    assert label_filters({"DDP_UP_JOB": "j1", "DDP_UP_NODE": "0"}) == [
        "--filter", "label=ddp-up.job=j1", "--filter", "label=ddp-up.node=0", *mine]
    assert label_filters({}) == ["--filter", "label=ddp-up.job", *mine]  # ddp-kill --all: every job of this user's
    assert f"--label=ddp-up.uid={os.getuid()}" in Box(CONF, TAGS, "/work").run_argv(["true"])


def test_the_env_file_is_private_and_never_replaces_another(tmp_path):
    path = tmp_path / "env.json"
    container.write_env(str(path), {"TOKEN": "x"})
    assert path.stat().st_mode & 0o777 == 0o600
    with pytest.raises(FileExistsError):
        container.write_env(str(path), {"TOKEN": "y"})


def test_dry_run_prints_the_container_command_and_the_masked_environment(tmp_path):
    cfg = parse("""\
        container: {image: img:1, runtime: podman}
        env: {HF_TOKEN: hf_abcdefgh}
        nodes: [{host: a, gpus: 2}]
        """)
    plan = make_plan(cfg, "t.py", ["--lr", "1"], "j1", str(tmp_path))
    line = plan.shell_line(plan.nodes[0], 29500)
    assert "HF_TOKEN=***" in line and "hf_abcdefgh" not in line
    command = line.splitlines()[-1]
    assert command.startswith("podman run --rm --name ddp-up-j1-n0-a0 ") and " img:1 python3 -S -c " in command
    assert "--device=nvidia.com/gpu=1" in command and command.endswith("--redirects=3 t.py --lr 1")


def test_an_images_versions_are_kept_per_image_id_and_what_else_they_depend_on(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    box = Box(CONF, TAGS, "/work")
    key = image.versions_key(box, "sha256:abc")
    assert key.startswith(".versions-") and key != image.versions_key(Box(dict(CONF, mounts=[]), TAGS, "/work"),
                                                                          "sha256:abc")
    assert image.read_versions(key) is None
    image.keep_versions(key, {"torch": "2.13.0"})
    assert image.read_versions(key) == {"torch": "2.13.0"}
    other = tmp_path / "elsewhere.json"
    other.write_text('{"torch": "9"}')
    link = Path(image.state_root()) / ".versions-link.json"
    link.symlink_to(other)
    assert image.read_versions(link.name) is None  # never through a link
    assert image.versions_key(Box(dict(CONF, runtime="apptainer"), TAGS, "/work"), None) is None  # no image id


@pytest.mark.parametrize("text, words", [
    ("{image: -v}", "container.image: must be an image's name or path, not an option"),
    ("{image: i, options: [-dt]}", "container.options[0]: -dt is ddp-up's own"),
    ("{image: i, options: [--rm, -itd]}", "container.options[0]: --rm is ddp-up's own"),
    ("{image: i, options: [-itd]}", "container.options[0]: -itd is ddp-up's own"),
    ("{image: i, options: ['--label-file=/x']}", "container.options[0]: --label-file is ddp-up's own"),
])
def test_an_image_that_is_an_option_and_bundled_or_file_labels_are_refused(text, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        parse_cluster(f"nodes: [{{host: a, gpus: 1}}]\ncontainer: {text}\n", "c.yaml")
    assert parse_cluster("nodes: [{host: a, gpus: 1}]\ncontainer: {image: i, options: [-v/a:/b, -eFOO=1, -it2]}\n",
                         "c.yaml").nodes[0].container.options == ("-v/a:/b", "-eFOO=1", "-it2")


def test_an_images_versions_unused_for_a_month_are_forgotten(tmp_path, monkeypatch):
    from orchestrator.node.local import state

    monkeypatch.setattr(state.tempfile, "tempdir", str(tmp_path))
    root = Path(state.state_root())
    root.mkdir(mode=0o700)
    image.keep_versions(".versions-old.json", {"torch": "2.1"})
    image.keep_versions(".versions-used.json", {"torch": "2.2"})
    month = time.time() - image.VERSIONS_KEPT - 60
    for name in (".versions-old.json", ".versions-used.json"):
        os.utime(root / name, (month, month))
    assert image.read_versions(".versions-used.json") == {"torch": "2.2"}  # read: used now
    image.keep_versions(".versions-new.json", {"torch": "2.3"})
    assert sorted(p.name for p in root.iterdir()) == [".versions-new.json", ".versions-used.json"]
