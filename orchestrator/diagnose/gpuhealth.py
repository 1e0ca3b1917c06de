"""Which of the GPU facts every agent reports (node/probes/gpuhealth.py) stop a launch. Pure: findings as values.

A data-parallel job runs at the pace of its slowest GPU, and a GPU with memory errors waiting can
end it hours in. Fatal: what makes a GPU wrong or far slower until someone acts (uncorrected ECC
errors, pages or rows waiting for a reset, a failed remap, a hardware slowdown). These refuse the
launch as a busy GPU does, unless --allow-unhealthy-gpus. A warning: what slows a GPU without
making it wrong (a software thermal slowdown, a PCIe link below its maximum, an NVLink down);
it is said, and the job starts.

A PCIe link's generation drops while its GPU is idle, to save power, and comes back under load:
a generation below the maximum counts only where the GPU is not idle. Its width does not change.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import NodeProblem
from ..node.probes.gpuhealth import DECIDING
from .outcome import NodeStatus

RESET = "reset the GPU (`nvidia-smi -r -i {index}` as root, with nothing running on it) or reboot the node"
DRAIN = "drain the node until the GPU is replaced"
COOLING = "check the node's cooling and power (`nvidia-smi -q -d PERFORMANCE,TEMPERATURE,POWER`), and drain it meanwhile"


UNREAD = ("run `nvidia-smi -q{where}` on the node to see what the driver says, and fix the driver or the GPU "
          "(a lost GPU needs a reset or a reboot)")
@dataclass(frozen=True)
class GpuFinding:
    gpu: int | None  # nvidia-smi's index; None where its answer did not say which GPU
    what: str
    fix: str
    fatal: bool

    def text(self) -> str:
        return f"GPU {self.gpu}: {self.what}" if self.gpu is not None else f"GPUs: {self.what}"


def findings(gpu: dict) -> list[GpuFinding]:
    """Everything wrong with one GPU's facts, fatal first."""
    index = gpu.get("index")
    found = []

    def add(what: str, fix: str, fatal: bool) -> None:
        found.append(GpuFinding(index, what, fix.format(index=index), fatal))

    where = UNREAD.replace("{where}", "" if index is None else " -i {index}")
    if gpu.get("failed"):  # nvidia-smi itself: every GPU of the node
        add(f"{gpu['failed']}: their health is unknown", where, True)
    unread = [str(what) for what in gpu.get("unreadable") or []][:4]
    if unread:  # fails closed: what could not be read may hide an error
        deciding = index is None or any(what.split(" ")[0] in DECIDING for what in unread)
        said = "; ".join(unread)
        add(f"nvidia-smi's answer could not be read ({said}): its health is unknown" if deciding else
            f"nvidia-smi wrote what could not be read: {said}", where, deciding)
    errors = gpu.get("ecc_uncorrected")
    if isinstance(errors, int) and errors > 0:
        add(f"{errors} uncorrected ECC error(s) since the driver loaded: results on it may be wrong",
            RESET + "; if they come back, " + DRAIN, True)
    if gpu.get("retired_pending"):
        add("memory pages wait to be retired, at the GPU's next reset", RESET, True)
    if gpu.get("remap_pending"):
        add("memory rows wait to be remapped, at the GPU's next reset", RESET, True)
    if gpu.get("remap_failed"):
        add("a memory row remapping failed: the GPU cannot set its bad memory aside", DRAIN, True)
    causes = [name for flag, name in (("hw_thermal", "thermal"), ("power_brake", "power brake")) if gpu.get(flag)]
    if gpu.get("hw_slowdown") or causes:  # the driver sets HW slowdown with either cause, or alone
        cause = f" ({', '.join(causes)})" if causes else ""
        add(f"HW slowdown{cause} active{_clocks(gpu)}: it runs at half its clock or less", COOLING, True)
    if gpu.get("sw_thermal"):
        add(f"SW thermal slowdown active{_clocks(gpu)}", COOLING, False)
    found += _link_findings(gpu)
    return sorted(found, key=lambda f: not f.fatal)


def _clock_text(gpu: dict) -> str:
    """``37 °C, SM clock 345 of 1980 MHz``, of what the driver said; "" if nothing."""
    parts = []
    if gpu.get("temp") is not None:
        parts.append(f"{gpu['temp']} °C")
    if gpu.get("sm_clock") is not None and gpu.get("sm_max"):
        parts.append(f"SM clock {gpu['sm_clock']} of {gpu['sm_max']} MHz")
    return ", ".join(parts)


def _clocks(gpu: dict) -> str:
    text = _clock_text(gpu)
    return f" ({text})" if text else ""


def _link_findings(gpu: dict) -> list[GpuFinding]:
    index, found = gpu.get("index"), []
    width, width_max = gpu.get("pcie_width"), gpu.get("pcie_width_max")
    if isinstance(width, int) and isinstance(width_max, int) and width < width_max:
        found.append(GpuFinding(index, f"PCIe link x{width} of x{width_max}: host-device copies run at "
                                       f"{width}/{width_max} speed", "reseat the GPU or check its slot and riser", False))
    gen, gen_max = gpu.get("pcie_gen"), gpu.get("pcie_gen_max")
    # idle: read off the clock event mask by node/probes/gpuhealth.py; unknown counts as idle (nothing said)
    if isinstance(gen, int) and isinstance(gen_max, int) and gen < gen_max and not gpu.get("idle", True):
        found.append(GpuFinding(index, f"PCIe link at gen {gen} of {gen_max} while in use",
                                "check the slot's and the BIOS's PCIe settings", False))
    if gpu.get("nvlink_down"):
        links = ", ".join(str(n) for n in gpu["nvlink_down"])
        found.append(GpuFinding(index, f"NVLink link(s) {links} down while its others are up: collectives "
                                       "between GPUs slow down", "check `nvidia-smi nvlink --status`; "
                                + RESET.format(index=index), False))
    return found


def describe(gpu: dict) -> str:
    """One line of what nvidia-smi says about a GPU, for a slow one in ddp-check --gpus."""
    parts = [f.what for f in findings(gpu)] or ["nothing wrong by nvidia-smi"]
    parts.append(_clock_text(gpu))
    if gpu.get("pcie_gen") is not None and gpu.get("pcie_width") is not None:
        parts.append(f"PCIe gen {gpu['pcie_gen']} x{gpu['pcie_width']}")
    return "; ".join(p for p in parts if p)


def health_of(info: dict) -> list[dict]:
    """What nvidia-smi said of a node's GPUs at its preflight (its Ready's ``gpu_health``), one dict a GPU."""
    return [g for g in info.get("gpu_health") or [] if isinstance(g, dict)]


def said_of(statuses: list[NodeStatus]) -> dict[str, str]:
    """{node index as text: what nvidia-smi said of its GPUs at the preflight}, in words: why a node
    set aside for straggling may be slow (ddp-up's own words, job/pace.py; a detached job's supervisor's)."""
    said = {}
    for s in statuses:
        health = health_of(s.info)
        said[str(s.plan.index)] = "; ".join(f"GPU {g.get('index', '?')}: {describe(g)}" for g in health) or \
            "no GPU facts (nvidia-smi gave none)"
    return said


def health_problems(statuses: list[NodeStatus], allowed: bool) -> tuple[list[NodeProblem], list[str]]:
    """Fatal findings on the job's GPUs as problems (notices with --allow-unhealthy-gpus), and
    warnings as notices."""
    problems, notices = [], []
    for s in statuses:
        for gpu in health_of(s.info):
            for f in findings(gpu):
                if f.fatal and not allowed:
                    problems.append(NodeProblem(s.plan.label, f.text(), f"{f.fix}; or pass --allow-unhealthy-gpus "
                                                                        "to start on it anyway"))
                else:
                    notices.append(f"{s.plan.label}: {f.text()}" + (" (--allow-unhealthy-gpus)" if f.fatal else
                                                                     f"; {f.fix}"))
    return problems, notices
