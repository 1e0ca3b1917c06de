"""GPU health at every preflight (node/probes/gpuhealth.py parses, diagnose/gpuhealth.py judges), from
what a real H100 and a real H200 answered (tests/data/gpu/health/), then variants of those rows
that change one field each, as a sick GPU would answer."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.config.clusterfile import parse_cluster
from orchestrator.diagnose import gpuhealth as judge
from orchestrator.diagnose.outcome import NodeStatus
from orchestrator.node.probes import facts, gpuhealth
from orchestrator.node.probes import smi as smi_module
from orchestrator.plan.launch import make_plan

DATA = Path(__file__).parent.parent / "data" / "gpu" / "health"
H100_HEALTH = (DATA / "h100" / "smi-health.csv").read_text()


def variant(text: str, **fields: str) -> str:
    """``text``'s one GPU row with the named headers' values replaced (header: value)."""
    header, row = text.splitlines()[:2]
    names = [h.strip() for h in header.split(",")]
    values = [v.strip() for v in row.split(",")]
    for name, value in fields.items():
        values[names.index(name.replace("__", "."))] = value
    return header + "\n" + ", ".join(values) + "\n"


def test_every_field_of_the_h100s_answer_is_read_as_the_driver_gave_it():
    [gpu] = gpuhealth.parse_health(H100_HEALTH)
    assert gpu == {
        "index": 0, "uuid": "GPU-89f07d02-c8e7-9f5a-d832-7510023d90e2", "name": "NVIDIA H100 80GB HBM3",
        "bus": "00000000:00:06.0", "temp": 37, "sm_clock": 345, "sm_max": 1980, "reasons": 1,
        "hw_slowdown": False, "sw_thermal": False, "sw_power_cap": False, "ecc_uncorrected": 0, "ecc_corrected": 0,
        "retired_pending": None, "remap_pending": False, "remap_failed": False, "pcie_gen": 5, "pcie_gen_max": 5,
        "pcie_width": 16, "pcie_width_max": 16,
        # not queried in this capture: read off the active mask (0x1: idle)
        "idle": True, "hw_thermal": False, "power_brake": False}
    assert judge.findings(gpu) == []


def test_the_new_event_headers_and_the_old_throttle_names_mean_the_same():
    [events] = gpuhealth.parse_health((DATA / "h100" / "smi-events.csv").read_text())
    assert {k: events[k] for k in ("reasons", "hw_slowdown", "hw_thermal", "power_brake", "sw_thermal")} == \
        {"reasons": 1, "hw_slowdown": False, "hw_thermal": False, "power_brake": False, "sw_thermal": False}
    assert gpuhealth.header_key("clocks_throttle_reasons.hw_slowdown") == \
        gpuhealth.header_key("clocks_event_reasons.hw_slowdown") == "hw_slowdown"
    assert gpuhealth.header_key("clocks.current.sm [MHz]") == gpuhealth.header_key("clocks.sm") == "sm_clock"


@pytest.mark.parametrize("name", ["smi-ddpup-health.csv", "smi-ddpup-basic.csv", "smi-health.csv"])
def test_what_the_h200_answered_to_ddp_ups_own_queries_is_healthy(name):
    [gpu] = gpuhealth.parse_health((DATA / "h200" / name).read_text())
    assert gpu["name"] == "NVIDIA H200" and gpu["uuid"].startswith("GPU-8b441aa0")
    assert (gpu["pcie_gen"], gpu["pcie_width"]) == (5, 16) and gpu["ecc_uncorrected"] == 0
    assert gpu["hw_slowdown"] is False and gpu["power_brake"] is False
    assert judge.findings(gpu) == []


def test_the_query_asks_what_the_h200_answered_and_falls_back_to_the_basic_one(monkeypatch):
    header = (DATA / "h200" / "smi-ddpup-health.csv").read_text().splitlines()[0]
    assert len(header.split(",")) == len(gpuhealth.HEALTH_FIELDS)
    asked = []

    def smi(args, run=None):
        asked.append(args[0])
        if args[0] == "--query-gpu=" + ",".join(gpuhealth.HEALTH_FIELDS):
            return None, "nvidia-smi exited with status 2"  # an older driver: "not a valid field to query"
        return ((DATA / "h200" / "smi-ddpup-basic.csv").read_text(), None) if args[0].startswith("--query-gpu") else (None, "")
    monkeypatch.setattr(smi_module, "nvidia_smi_said", smi)
    monkeypatch.setattr(facts, "has_nvidia_gpus", lambda: True)
    [gpu] = gpuhealth.query_health(None, 1)
    assert gpu["index"] == 0 and gpu["hw_slowdown"] is False  # from the mask
    assert len(asked) == 2  # one GPU: no NVLink to ask about
    monkeypatch.setattr(facts, "has_nvidia_gpus", lambda: False)
    assert gpuhealth.query_health(None, 1) == []  # a CPU node asks nothing


FATAL = [
    (dict(ecc__errors__uncorrected__volatile__total="2"), "2 uncorrected ECC error(s)", "nvidia-smi -r -i 0"),
    (dict(remapped_rows__pending="Yes"), "rows wait to be remapped", "reset the GPU"),
    (dict(remapped_rows__failure="Yes"), "remapping failed", "drain the node"),
    (dict(retired_pages__pending="Yes"), "pages wait to be retired", "reset the GPU"),
    (dict(clocks_event_reasons__hw_slowdown="Active"), "HW slowdown active (37 °C, SM clock 345 of 1980 MHz)",
     "cooling and power"),
    (dict(clocks_event_reasons__active="0x0000000000000088", clocks_event_reasons__hw_slowdown="[N/A]"),
     "HW slowdown (power brake) active", "cooling and power"),
]


@pytest.mark.parametrize("fields,what,fix", FATAL)
def test_a_gpu_that_would_give_wrong_answers_or_crawl_is_fatal(fields, what, fix):
    [gpu] = gpuhealth.parse_health(variant(H100_HEALTH, **fields))
    found = judge.findings(gpu)
    assert found and found[0].fatal, found
    assert what in found[0].text() and fix in found[0].fix


def test_a_slow_link_or_a_soft_slowdown_is_a_warning_and_an_idle_link_generation_is_nothing():
    def warned(**fields):
        return [(f.fatal, f.what) for f in judge.findings(gpuhealth.parse_health(variant(H100_HEALTH, **fields))[0])]
    assert warned(pcie__link__width__current="8") == [(False, "PCIe link x8 of x16: host-device copies run at 8/16 "
                                                              "speed")]
    assert warned(pcie__link__gen__current="3") == []  # idle (0x1): the link trains down to save power
    assert warned(pcie__link__gen__current="3", clocks_event_reasons__active="0x0000000000000000") == \
        [(False, "PCIe link at gen 3 of 5 while in use")]
    assert warned(clocks_event_reasons__sw_thermal_slowdown="Active") == \
        [(False, "SW thermal slowdown active (37 °C, SM clock 345 of 1980 MHz)")]


NVLINK = """GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-aaaa)
\t Link 0: 25 GB/s
\t Link 1: <inactive>
\t Link 2: 25 GB/s
GPU 1: NVIDIA A100-SXM4-80GB (UUID: GPU-bbbb)
\t Link 0: 25 GB/s
\t Link 1: 25 GB/s
\t Link 2: 25 GB/s
GPU 2: NVIDIA A100 80GB PCIe (UUID: GPU-cccc)
\t Link 0: <inactive>
\t Link 1: <inactive>
"""


def test_an_nvlink_down_beside_links_that_are_up_is_named_and_a_board_without_nvlink_is_not():
    assert gpuhealth.parse_nvlink(NVLINK) == {0: [1]}
    assert gpuhealth.parse_nvlink("") == {}  # one GPU: nvidia-smi prints nothing
    [gpu] = gpuhealth.parse_health(H100_HEALTH)
    found = judge.findings(dict(gpu, nvlink_down=[1]))
    assert [(f.fatal, f.what[:24]) for f in found] == [(False, "NVLink link(s) 1 down wh")]


def test_fatal_findings_refuse_the_launch_unless_allowed_and_warnings_never_do():
    plan = make_plan(parse_cluster("nodes: [{host: a, gpus: 1}, {host: b, gpus: 1}]\n"), "t.py", [], "J", "/")
    [healthy] = gpuhealth.parse_health(H100_HEALTH)
    [sick] = gpuhealth.parse_health(variant(H100_HEALTH, ecc__errors__uncorrected__volatile__total="3"))
    [narrow] = gpuhealth.parse_health(variant(H100_HEALTH, pcie__link__width__current="8"))
    statuses = [NodeStatus(plan.nodes[0], info={"gpu_health": [healthy, narrow]}),
                NodeStatus(plan.nodes[1], info={"gpu_health": [sick]})]
    problems, notices = judge.health_problems(statuses, allowed=False)
    assert [(p.node, p.what[:33]) for p in problems] == [("b", "GPU 0: 3 uncorrected ECC error(s)")]
    assert "--allow-unhealthy-gpus" in problems[0].fix
    assert notices == ["a: GPU 0: PCIe link x8 of x16: host-device copies run at 8/16 speed; reseat the GPU or "
                       "check its slot and riser"]
    problems, notices = judge.health_problems(statuses, allowed=True)
    assert problems == [] and notices[1].endswith("(--allow-unhealthy-gpus)")


def test_no_gpu_or_no_answer_is_healthy():
    plan = make_plan(parse_cluster("nodes: [{host: a, gpus: 1}]\n"), "t.py", [], "J", "/")
    assert judge.health_problems([NodeStatus(plan.nodes[0], info={})], allowed=False) == ([], [])
    assert gpuhealth.parse_health(None) == []
    [unread] = gpuhealth.parse_health("garbage\n1,2,3\n")  # no row of the header's: never passed over
    assert unread["index"] is None and "3 fields for 1 columns" in unread["unreadable"][0]
