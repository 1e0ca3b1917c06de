"""What nvidia-smi says about the health of a node's GPUs: stdlib only, shipped with the agent.

One ``--query-gpu`` (and, on a node with several GPUs, ``nvidia-smi nvlink --status``) at each
preflight. Parsing is by the CSV's own header, not by position: drivers answer the old names
(``clocks_throttle_reasons.*``) under the new headers (``clocks_event_reasons.*``), add units to
some, and older ones refuse fields they do not know, so the query falls back to a smaller one.
What comes out is facts, one dict a GPU; which of them stop a launch is the controller's decision
(diagnose/gpuhealth.py), so a drain script and ddp-up judge them alike.
"""

from . import facts

# the queried fields; the old names are answered by every driver that knows the new ones
HEALTH_FIELDS = ("index", "uuid", "name", "pci.bus_id", "temperature.gpu", "clocks.sm", "clocks.max.sm",
                 "clocks_throttle_reasons.active", "clocks_throttle_reasons.hw_slowdown",
                 "clocks_throttle_reasons.hw_thermal_slowdown", "clocks_throttle_reasons.hw_power_brake_slowdown",
                 "clocks_throttle_reasons.sw_thermal_slowdown", "ecc.errors.uncorrected.volatile.total",
                 "retired_pages.pending", "remapped_rows.pending", "remapped_rows.failure",
                 "pcie.link.gen.current", "pcie.link.gen.max", "pcie.link.width.current", "pcie.link.width.max")
# what every driver of the last decade answers (no remapped rows before Ampere's, no brake field)
BASIC_FIELDS = ("index", "uuid", "name", "pci.bus_id", "temperature.gpu", "clocks.sm", "clocks.max.sm",
                "clocks_throttle_reasons.active", "ecc.errors.uncorrected.volatile.total", "retired_pages.pending",
                "pcie.link.gen.current", "pcie.link.gen.max", "pcie.link.width.current", "pcie.link.width.max")

# header (units and the throttle/event prefix dropped) -> the fact's key
KEYS = {"index": "index", "uuid": "uuid", "name": "name", "pci.bus_id": "bus", "temperature.gpu": "temp",
        "clocks.current.sm": "sm_clock", "clocks.sm": "sm_clock", "clocks.max.sm": "sm_max",
        "reasons.active": "reasons", "reasons.hw_slowdown": "hw_slowdown",
        "reasons.hw_thermal_slowdown": "hw_thermal", "reasons.hw_power_brake_slowdown": "power_brake",
        "reasons.sw_thermal_slowdown": "sw_thermal", "reasons.sw_power_cap": "sw_power_cap",
        "ecc.errors.uncorrected.volatile.total": "ecc_uncorrected",
        "ecc.errors.corrected.volatile.total": "ecc_corrected", "retired_pages.pending": "retired_pending",
        "remapped_rows.pending": "remap_pending", "remapped_rows.failure": "remap_failed",
        "pcie.link.gen.current": "pcie_gen", "pcie.link.gen.max": "pcie_gen_max",
        "pcie.link.width.current": "pcie_width", "pcie.link.width.max": "pcie_width_max"}
TEXT_KEYS = ("uuid", "name", "bus")
# clock event reasons, as the bits of reasons.active (nvml's nvmlClocksEventReasons)
REASON_BITS = {"idle": 0x1, "sw_power_cap": 0x4, "hw_slowdown": 0x8, "sw_thermal": 0x20, "hw_thermal": 0x40,
               "power_brake": 0x80}
FLAGS = ("hw_slowdown", "hw_thermal", "power_brake", "sw_thermal", "sw_power_cap")


def header_key(header):
    """The fact's key for one CSV header: ``clocks_event_reasons.hw_slowdown`` and
    ``clocks_throttle_reasons.hw_slowdown`` alike, ``clocks.current.sm [MHz]`` as ``clocks.current.sm``."""
    name = header.split("[")[0].strip()
    for prefix in ("clocks_event_reasons.", "clocks_throttle_reasons."):
        if name.startswith(prefix):
            name = "reasons." + name[len(prefix):]
    return KEYS.get(name)


def value_of(key, text):
    """One field's value: text for names, True/False for Active/Yes, an int for numbers and bit
    masks (units dropped), None for what the driver does not know ([N/A], Not Supported)."""
    text = text.strip()
    if key in TEXT_KEYS:
        return text
    lowered = text.lower()
    if lowered in ("active", "yes"):
        return True
    if lowered in ("not active", "no"):
        return False
    if lowered.startswith("0x"):
        try:
            return int(lowered, 16)
        except ValueError:
            return None
    number = text.split(" ")[0]
    try:
        return int(float(number))
    except ValueError:
        return None


def parse_health(text):
    """[{key: value}] a GPU, from ``--query-gpu=... --format=csv`` with its header line."""
    keys, gpus = None, []
    for row in facts.csv_rows(text):
        if keys is None:
            keys = [header_key(h) for h in row]
            continue
        gpu = {k: value_of(k, v) for k, v in zip(keys, row) if k}
        if isinstance(gpu.get("index"), int):
            gpus.append(with_reason_bits(gpu))
    return gpus


def with_reason_bits(gpu):
    """Each clock event flag the driver did not answer on its own, read off the active mask."""
    mask = gpu.get("reasons")
    if isinstance(mask, int):
        for flag, bit in REASON_BITS.items():
            if gpu.get(flag) is None:
                gpu[flag] = bool(mask & bit)
    return gpu


def parse_nvlink(text):
    """{gpu index: [indices of its links reported inactive]}, only for GPUs with at least one link up
    (a GPU with none up has no NVLink in use, as on a PCIe board), from ``nvidia-smi nvlink --status``."""
    links, gpu = {}, None
    for line in (text or "").splitlines():
        stripped = line.strip()
        if stripped.startswith("GPU ") and ":" in stripped:
            head = stripped[4:].split(":")[0]
            gpu = int(head) if head.isdigit() else None
            if gpu is not None:
                links[gpu] = ([], [])
        elif gpu is not None and stripped.startswith("Link ") and ":" in stripped:
            number, state = stripped[5:].split(":", 1)
            if number.strip().isdigit():
                links[gpu][1 if "inactive" in state.lower() else 0].append(int(number))
    return {g: down for g, (up, down) in links.items() if up and down}


def query_health(visible, nproc):
    """The health facts of the job's GPUs (facts.job_gpu_indices), each with ``nvlink_down`` where
    some of its links are; [] where there are no NVIDIA GPUs or nvidia-smi does not answer."""
    if not facts.has_nvidia_gpus():
        return []
    text = None
    for fields in (HEALTH_FIELDS, BASIC_FIELDS):
        text = facts.nvidia_smi(["--query-gpu=" + ",".join(fields), "--format=csv"])
        if text is not None:
            break
    every = parse_health(text)
    used = facts.job_gpu_indices(visible, nproc, every)
    gpus = [g for g in every if g["index"] in used]
    down = parse_nvlink(facts.nvidia_smi(["nvlink", "--status"])) if len(gpus) > 1 else {}
    for gpu in gpus:
        if down.get(gpu["index"]):
            gpu["nvlink_down"] = down[gpu["index"]]
    return gpus
