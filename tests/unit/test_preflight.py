from orchestrator.config.clusterfile import parse_cluster
import os

from orchestrator.node.attempt import checks
from orchestrator.diagnose.preflight import gpu_shortfalls, torch_mismatches
from orchestrator.diagnose.outcome import NodeStatus
from orchestrator.plan.launch import make_plan


def test_more_processes_than_gpus_is_refused_but_cpu_nodes_are_not():
    plan = make_plan(parse_cluster("nodes: [{host: a, gpus: 8}, {host: b, gpus: 8}, {host: c, gpus: 2}]\n"),
                     "t.py", [], "J", "/")
    statuses = [NodeStatus(plan.nodes[0], info={"gpus": 8}), NodeStatus(plan.nodes[1], info={"gpus": 4}),
                NodeStatus(plan.nodes[2], info={"gpus": 0})]
    problems = gpu_shortfalls(statuses)
    assert [(p.node, p.what, p.fix) for p in problems] == [("b", "gpus: 8 but the node has 4 GPU(s)", "set `gpus: 4` for this node")]


def test_torch_cuda_and_nccl_must_match_the_master_where_known():
    plan = make_plan(parse_cluster("nodes: [{host: m, gpus: 1}, {host: a, gpus: 1}, {host: b, gpus: 1}, "
                                   "{host: c, gpus: 1}]\n"), "t.py", [], "J", "/")
    build = {"torch": "2.4.0+cu121", "cuda": "12.1", "nccl": "2.20.5"}
    infos = [build, {**build, "nccl": "2.18.1"}, {**build, "nccl": None}, {**build, "torch": "2.3.1+cu118",
                                                                          "cuda": "11.8"}]
    problems = torch_mismatches([NodeStatus(n, info=i) for n, i in zip(plan.nodes, infos)], master_index=0)
    assert [(p.node, p.what) for p in problems] == [
        ("a", "torch 2.4.0+cu121 (NCCL 2.18.1) here, torch 2.4.0+cu121 (NCCL 2.20.5) on the master (m)"),
        ("c", "torch 2.3.1+cu118 (CUDA 11.8) here, torch 2.4.0+cu121 (CUDA 12.1) on the master (m)")]  # b: unknown


def test_the_torch_probe_reads_versions_without_importing_torch():
    info = checks.probe_torch(dict(os.environ))
    assert info["torch"].startswith("2.13.0") and info["cuda"] is None and info["nccl"] is None  # the CPU wheel


def fake_site(root, cuda, nccl_wheels, built=None):
    """A site folder with a torch built for CUDA (None: a CPU build) and NCCL wheels installed;
    ``built``: the version its version.py says (None: none, and the probe reads the metadata's)."""
    (root / "torch").mkdir(parents=True)
    (root / "torch" / "__init__.py").write_text("raise SystemExit('the probe must not import torch')\n")
    said = f"__version__ = {built!r}\n" if built else ""
    (root / "torch" / "version.py").write_text(f"{said}cuda: Optional[str] = {cuda!r}\n")
    for name, version in [("torch", "2.9.0")] + nccl_wheels:
        meta = root / f"{name.replace('-', '_')}-{version}.dist-info"
        meta.mkdir()
        (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return {**os.environ, "PYTHONPATH": str(root)}


def test_the_version_file_says_the_torch_version_and_its_metadata_only_where_it_does_not(tmp_path):
    info = checks.probe_torch(fake_site(tmp_path, None, [], built="2.9.0a0+git1234"))  # a source build's
    assert info == {"torch": "2.9.0a0+git1234", "cuda": None, "nccl": None}


def test_a_cpu_torch_has_no_nccl_whatever_wheel_a_cuda_install_left(tmp_path):
    # the README's two installs in one venv: the demo's CUDA torch, then the tests' CPU torch
    info = checks.probe_torch(fake_site(tmp_path, None, [("nvidia-nccl-cu13", "2.30.7")]))
    assert info == {"torch": "2.9.0", "cuda": None, "nccl": None}


def test_a_cuda_torch_reports_the_nccl_wheel_of_its_cuda_major(tmp_path):
    info = checks.probe_torch(fake_site(tmp_path, "12.8", [("nvidia-nccl-cu13", "2.30.7"), ("nvidia-nccl-cu12", "2.26.2")]))
    assert info == {"torch": "2.9.0", "cuda": "12.8", "nccl": "2.26.2"}
