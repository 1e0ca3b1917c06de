"""nvidia-smi's answers are untrusted input: a real executable on PATH in its place answers each
query with what a broken driver, a strange board or a hostile PATH might print, and the agent's
GPU queries (health, busy GPUs, the dashboard's sample, NVLink) stay total and bounded: a field
that cannot be read is named, a row that cannot be read whole fails closed (the GPU named and taken
for unhealthy), a failing or hanging nvidia-smi is named with what it said."""

from __future__ import annotations

import os
import stat
import time

import pytest

from orchestrator.diagnose import gpuhealth as judge
from orchestrator.node.probes import facts, gpuhealth, smi

HEADER = ("index, uuid, name, pci.bus_id, temperature.gpu, clocks.current.sm [MHz], clocks.max.sm [MHz], "
          "clocks_event_reasons.active, ecc.errors.uncorrected.volatile.total, retired_pages.pending, "
          "pcie.link.gen.current, pcie.link.gen.max, pcie.link.width.current, pcie.link.width.max")
GOOD = "0, GPU-aaaa, NVIDIA H100, 00000000:18:00.0, 37, 345 MHz, 1980 MHz, 0x0000000000000001, 0, No, 5, 5, 16, 16"


def row(**over):
    fields = dict(zip([h.split(" [")[0] for h in HEADER.split(", ")], GOOD.split(", ")))
    fields.update({k.replace("__", "."): v for k, v in over.items()})
    return ", ".join(fields.values())


# what nvidia-smi prints for the health query -> what the GPU's findings must say (fatal or not)
HEALTH = {
    "a count past Python's int limit": (row(ecc__errors__uncorrected__volatile__total="9" * 5000), "its row", True),
    "a count past 64 bits": (row(ecc__errors__uncorrected__volatile__total="9" * 400), "ecc_uncorrected", True),
    "inf": (row(temperature__gpu="inf"), "temp 'inf'", False),
    "1e400": (row(ecc__errors__uncorrected__volatile__total="1e400"), "ecc_uncorrected", True),
    "nan": (row(ecc__errors__uncorrected__volatile__total="nan"), "ecc_uncorrected", True),
    "superscript digits": (row(index="²"), "its index", True),
    "an Arabic-Indic index": (row(index="٣"), "its index", True),
    "an [N/A] index": (row(index="[N/A]"), "its index", True),
    "a field over the csv module's limit": (row(name="x" * 200_000), "its row", True),
    "a comma in the GPU's name": (row(name="NVIDIA H100, rev 2"), "15 fields for 14 columns", True),
    "an unterminated quote": (row(name='"NVIDIA H100'), None, False),  # a quote is text: the row stands
    "a bad hex mask": (row(clocks_event_reasons__active="0xzz"), "reasons", True),
    "a hex mask of 200 digits": (row(clocks_event_reasons__active="0x" + "f" * 200), "reasons", True),
}


def fake_smi(tmp_path, monkeypatch, health="", code=0, said="", sleep=0, apps="", gpus="", nvlink=""):
    """An executable nvidia-smi on PATH that answers each query from files, and a driver that lists GPUs."""
    where = tmp_path / "smi"
    where.mkdir(exist_ok=True)
    for name, text in (("health", health), ("apps", apps), ("gpus", gpus), ("nvlink", nvlink), ("said", said + "\n")):
        (where / name).write_text(text)
    script = where / "nvidia-smi"
    script.write_text(f"""#!/bin/sh
sleep {sleep}
case "$1" in
  --query-gpu=index,uuid,name*) f=health ;;
  --query-compute-apps*) f=apps ;;
  --query-gpu=index,uuid,util*) f=gpus ;;
  nvlink) f=nvlink ;;
esac
[ {code} -ne 0 ] && {{ cat "{where}/said"; exit {code}; }}
cat "{where}/$f"
""")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{where}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(facts, "has_nvidia_gpus", lambda: True)
    monkeypatch.setattr(smi, "HANG", smi.HangMemory())  # this test's node: no hang remembered


@pytest.mark.parametrize("kind", sorted(HEALTH))
def test_a_health_answer_that_cannot_be_read_is_named_and_fails_closed(tmp_path, monkeypatch, kind):
    text, named, fatal = HEALTH[kind]
    fake_smi(tmp_path, monkeypatch, health=f"{HEADER}\n{GOOD.replace('0, GPU-aaaa', '1, GPU-bbbb')}\n{text}\n")
    gpus = gpuhealth.query_health(None, 0)
    found = [f for g in gpus for f in judge.findings(g)]
    if named is None:
        assert found == [] and len(gpus) == 2, (gpus, found)
        return
    assert any(named in f.what for f in found), (kind, gpus, found)
    assert any(f.fatal for f in found) is fatal, found
    assert all(len(f.what) < 1000 for f in found)  # named, not echoed whole


def test_a_gpu_with_ecc_errors_behind_a_shifted_row_still_stops_the_launch(tmp_path, monkeypatch):
    """Its name holds a comma: the row cannot be read whole, so the GPU fails closed, not passed over."""
    fake_smi(tmp_path, monkeypatch, health=f"{HEADER}\n{row(name='A, B', ecc__errors__uncorrected__volatile__total='12')}\n")
    [gpu] = gpuhealth.query_health(None, 0)
    assert [f.fatal for f in judge.findings(gpu)] == [True]


@pytest.mark.parametrize("code, said, words", [
    (15, "Unable to determine the device handle for GPU0000:18:00.0: GPU is lost.  Reboot the system", "GPU is lost"),
    (9, "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.", "couldn't communicate"),
])
def test_a_failing_nvidia_smi_on_a_node_whose_driver_lists_gpus_refuses_the_launch_and_says_why(
        tmp_path, monkeypatch, code, said, words):
    fake_smi(tmp_path, monkeypatch, code=code, said=said)
    [gpu] = gpuhealth.query_health(None, 0)
    [finding] = judge.findings(gpu)
    assert finding.fatal and f"nvidia-smi exited with status {code}" in finding.what and words in finding.what


def test_a_hung_nvidia_smi_is_bounded_named_and_asked_nothing_more(tmp_path, monkeypatch):
    monkeypatch.setattr(smi, "NVIDIA_SMI_TIMEOUT", 1.0)
    fake_smi(tmp_path, monkeypatch, sleep=30)
    start = time.monotonic()
    [gpu] = gpuhealth.query_health(None, 0)
    assert time.monotonic() - start < 5  # one query's bound, not one per query
    [finding] = judge.findings(gpu)
    assert finding.fatal and "nvidia-smi did not answer within 1 s" in finding.what


def test_one_hang_of_nvidia_smi_costs_a_node_one_bound_for_every_question_after(tmp_path, monkeypatch):
    """A preflight asks for the busy GPUs, their processes and their health: a wedged driver once
    cost 10 s for each. After one hang, nvidia-smi is not asked again for HUNG_QUIET."""
    monkeypatch.setattr(smi, "NVIDIA_SMI_TIMEOUT", 1.0)
    fake_smi(tmp_path, monkeypatch, sleep=30)
    start = time.monotonic()
    busy = facts.query_busy_gpus(None, 1)
    [gpu] = gpuhealth.query_health(None, 0)
    assert time.monotonic() - start < 4, time.monotonic() - start  # one bound (1 s), not three
    assert busy == [] and "nvidia-smi did not answer within 1 s" in judge.findings(gpu)[0].what
    smi.HANG.at -= smi.HUNG_QUIET  # a minute on: asked again
    assert smi.nvidia_smi_said(["-L"], run=lambda argv, timeout: (0, b"GPU 0\n", b"")) == ("GPU 0\n", None)


BUSY = {
    "a pid of superscript digits": ("GPU-aaaa, ³³, 100, python", []),
    "a pid past any pid": ("GPU-aaaa, " + "9" * 5000 + ", 100, python", []),
    "a row without a uuid": (", 41, 100, python", []),
    "inf MiB": ("GPU-aaaa, 41, inf, python", [None]),
    "a comma in the process's name": ("GPU-aaaa, 41, 100, python, -c, x", [100]),
}


@pytest.mark.parametrize("kind", sorted(BUSY))
def test_the_busy_gpu_and_usage_queries_are_total(tmp_path, monkeypatch, kind):
    apps, mib = BUSY[kind]
    fake_smi(tmp_path, monkeypatch, gpus="0, GPU-aaaa, 50, 100, 80000\n[N/A], GPU-bbbb, 1, 1, 1\n²,GPU-c,1,1,1\n",
             apps=apps + "\n")
    assert [b["mib"] for b in facts.query_busy_gpus(None, 1)] == mib
    assert facts.query_usage() == [[0, 50, 100, 80000]]


@pytest.mark.parametrize("text", ["GPU ²: x\n\t Link 0: 25 GB/s\n\t Link 1: <inactive>\n",
                                  "GPU 0: x\n\t Link ⁹: <inactive>\n\t Link 0: 25 GB/s\n",
                                  "GPU " + "9" * 5000 + ": x\n\t Link 0: <inactive>\n",
                                  "Link 0: <inactive>\nGPU\nGPU :\n:\n" + "x" * 100_000])
def test_odd_nvlink_text_is_passed_over(text):
    assert gpuhealth.parse_nvlink(text) == {}


def test_an_agent_whose_mode_raises_ends_with_its_traceback_not_an_abort(tmp_path):
    """A bug in an agent's mode reaches the user as the agent's traceback (exit 70), never as an abort
    at exit with no Python frame (daemon threads holding stdout)."""
    import subprocess
    import sys

    from orchestrator.config.clusterfile import parse_cluster
    from orchestrator.remote.channel import early_exit_problem

    code = ("from orchestrator.node import main\n"
            "main.answering = lambda spec: (lambda spec, writer: 1 // 0)\n"
            "main.main()\n")
    frames = tmp_path / "frames"
    from orchestrator.node.protocol import wire
    frames.write_bytes(wire.ListSpec().encode())
    with open(frames, "rb") as stdin:
        done = subprocess.run([sys.executable, "-c", code], stdin=stdin, capture_output=True, timeout=60)
    assert done.returncode == 70, done
    assert b"ZeroDivisionError" in done.stderr and b"Traceback" in done.stderr, done.stderr
    tail = done.stderr.decode().splitlines()
    problem = early_exit_problem(parse_cluster("nodes: [{host: a, gpus: 1}]\n").nodes[0], 70, tail)
    assert "the node agent failed" in problem.what and "ZeroDivisionError" in problem.what, problem


def test_a_slow_nvidia_smi_is_no_clock_skew(monkeypatch):
    """The node's clock goes in its Ready as the frame goes, after the GPU queries, however long
    they took (a hung nvidia-smi once showed as a clock 30 s behind)."""
    from types import SimpleNamespace

    from orchestrator.node.attempt import checks

    monkeypatch.setattr(facts, "query_busy_gpus", lambda *a: time.sleep(0.5) or [])
    monkeypatch.setattr(gpuhealth, "query_health", lambda *a: time.sleep(0.5) or [])
    before = time.time()
    frame = checks.ready(SimpleNamespace(nproc=1), {}, {}, 1, None)
    assert frame.time >= before + 1.0
