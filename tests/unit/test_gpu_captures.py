"""What ddp-up met on a real GPU (an NVIDIA H200, driver 580.159.04, torch 2.11.0+cu130, NCCL
2.28.9), read back from the captures under tests/data/gpu/h200 (tests/data/gpu/capture.sh made
them): nvidia-smi's exact queries, a GPU another process holds, NCCL's Flight Recorder records
of a hang, ddp-check --collective on one node. Each test reads the real bytes, not a fake's."""

from __future__ import annotations

import io
import json
import os
import shutil

from rich.console import Console

from orchestrator.diagnose import collective, flight
from orchestrator.node.probes import facts
from orchestrator.node.watch import flight as node_flight
from orchestrator.diagnose.outcome import gpu_summary
from orchestrator.diagnose.preflight import busy_gpu_text

DATA = os.path.join(os.path.dirname(__file__), "..", "data", "gpu", "h200")
UUID = "GPU-c663400e-6305-ca2a-bb03-947fec416f93"


def read(name: str) -> str:
    with open(os.path.join(DATA, name)) as f:
        return f.read()


def test_nvidia_smis_gpu_and_app_queries_are_read_as_the_driver_wrote_them():
    [idle] = facts.parse_gpus(read("smi-gpus-idle.csv"))
    assert idle == {"index": 0, "uuid": UUID, "util": 0, "used": 0, "total": 143771}
    assert facts.parse_apps(read("smi-apps-idle.csv")) == []  # no process: an empty answer, not an error
    [busy] = facts.parse_gpus(read("smi-gpus-busy.csv"))
    [app] = facts.parse_apps(read("smi-apps-busy.csv"))
    assert busy["used"] == 2575 and app == {"uuid": UUID, "pid": 1129, "mib": 2566, "name": "python3"}
    # the dashboard's gpu column, as the H200 run showed it ("0% 1/140G" while the job ran)
    assert gpu_summary([[0, busy["util"], busy["used"], busy["total"]]]) == "0% 3/140G"
    assert json.loads(read("probe.json"))["usage"] == [[0, 0, 0, 143771]]


def test_the_process_holding_the_gpu_is_named_by_uuid_and_pid():
    gpus, apps = facts.parse_gpus(read("smi-gpus-busy.csv")), facts.parse_apps(read("smi-apps-busy.csv"))
    owner = lambda pid: ("root", "python3 tests/data/gpu/hold.py /tmp/cap/held.flag")  # noqa: E731
    for visible in (None, "0", UUID, UUID[:12]):
        held = facts.busy_gpus(gpus, apps, facts.job_gpu_indices(visible, 1, gpus), owner)
        assert [(h["gpu"], h["pid"], h["mib"]) for h in held] == [(0, 1129, 2566)], visible
    assert facts.busy_gpus(gpus, apps, facts.job_gpu_indices("1", 1, gpus), owner) == []  # another GPU's job
    text = busy_gpu_text(facts.busy_gpus(gpus, apps, [0], owner))
    assert text in read("check-busy.txt") and text in read("up-busy.txt")  # what the real run said


def test_nccls_records_of_a_hang_name_the_collective_it_is_stuck_in(tmp_path):
    """nccl_hang.py: three all_reduces done, the fourth queued behind a spinning kernel."""
    shutil.copy(os.path.join(DATA, "record-nccl.0.json"), tmp_path / "nccl.0.json")
    shutil.copy(os.path.join(DATA, "record-fr.0.json"), tmp_path / "fr.0.json")  # the generic recorder: empty with NCCL
    records = node_flight.read_records(str(tmp_path))
    assert [(e[2], e[3], e[4]) for e in records[0]] == [(1, "all_reduce", True), (2, "all_reduce", True),
                                                        (3, "all_reduce", True), (4, "all_reduce", False)]
    frame = node_flight.snapshot(records)
    diagnosis = flight.diagnose(flight.parse(frame.ranks, range(1)), lambda rank: "localhost", 1)
    expected = json.loads(read("hang-rank0.collectives.json"))["diagnosis"]
    assert diagnosis.text == expected == ("Flight Recorder: on the default group, every rank completed all_reduce #3; "
                                          "rank 0 waits in all_reduce #4.")
    assert "collectives: " + expected in read("hang-console.txt")


def test_a_one_node_collective_check_shows_no_link_it_could_not_measure():
    """ddp-check --collective on the H200 alone showed busbw and both link directions as
    '0 bytes/s': a ring of one rank has nothing to measure."""
    assert "│    0 │ localhost │ 0 bytes/s │ 0 bytes/s │ 0.00 ms" in read("check-collective.txt")  # before the fix
    report = {"backend": "nccl", "world": 1, "links": [], "hosts": ["vm"], "seconds": 0.5, "arrivals": [[0.01] * 5],
              "all_reduce": [[65536, 0.04e-3], [1 << 20, 0.02e-3], [16 << 20, 0.03e-3]]}
    console = Console(file=io.StringIO(), width=120, record=True, color_system=None)
    console.print(collective.render(report, ["localhost"]))
    shown = console.export_text()
    assert "0 bytes/s" not in shown and "one node: no link to another node to measure" in shown
    assert "│ 16.8 MB │ 0.03 ms │ 559.2 GB/s │     - │" in shown  # algbw stays; busbw: none
