"""What nvidia-smi says about the health of a node's GPUs: stdlib only, shipped with the agent.

One ``--query-gpu`` (and, on a node with several GPUs, ``nvidia-smi nvlink --status``) at each
preflight. Parsing is by the CSV's own header, not by position: drivers answer the old names
(``clocks_throttle_reasons.*``) under the new headers (``clocks_event_reasons.*``), add units to
some, and older ones refuse fields they do not know, so the query falls back to a smaller one.
What comes out is facts, one dict a GPU; which of them stop a launch is the controller's decision
(diagnose/gpuhealth.py), so a drain script and ddp-up judge them alike.
"""

from . import facts, smi

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
    masks (units dropped), None for what the driver does not know ([N/A], Not Supported), and
    UNREADABLE for what is none of these (inf, ², a number of a thousand digits)."""
    text = text.strip()
    if key in TEXT_KEYS:
        return smi.clip(text)
    lowered = text.lower()
    if lowered in ("active", "yes"):
        return True
    if lowered in ("not active", "no"):
        return False
    if lowered.startswith("0x"):
        digits = lowered[2:]
        ok = 0 < len(digits) <= 16 and digits.isascii() and all(c in "0123456789abcdef" for c in digits)
        return int(digits, 16) if ok else UNREADABLE
    if lowered.startswith("[") or lowered in ("n/a", "not supported", "unknown error", "insufficient permissions"):
        return None
    number = facts.number(text.split(" ")[0])
    return UNREADABLE if number is None else number


UNREADABLE = object()  # a field nvidia-smi wrote that is no value of its kind
# What decides a GPU's health: unreadable, the GPU is taken for unhealthy (diagnose/gpuhealth.py reads it)
DECIDING = ("index", "ecc_uncorrected", "retired_pending", "remap_pending", "remap_failed", "reasons", "hw_slowdown",
            "hw_thermal", "power_brake")


def parse_health(text):
    """[{key: value}] a GPU, from ``--query-gpu=... --format=csv`` with its header line. Total: a
    field that cannot be read is named in the GPU's ``unreadable``; a row that cannot be read
    whole (its fields not the header's, its index not a number) is a GPU of its own with
    ``unreadable`` set and what can be told of it, so it is never passed over."""
    keys, gpus = None, []
    for number, row in enumerate(facts.csv_rows(text)):
        if keys is None:
            keys = [header_key(h) for h in row]
            continue
        if len(row) != len(keys):
            gpus.append({"index": None, "unreadable": ["its row (%d fields for %d columns): %s"
                                                       % (len(row), len(keys), smi.clip(",".join(row), 120))]})
            continue
        gpu, unreadable = {}, []
        for key, field in zip(keys, row):
            if key:
                value = value_of(key, field)
                if value is UNREADABLE:
                    unreadable.append("%s %r" % (key, smi.clip(field, 40)))
                    value = None
                gpu[key] = value
        if gpu.get("index") is None:
            unreadable.append("its index")
        if unreadable:
            gpu["unreadable"] = unreadable
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
    (a GPU with none up has no NVLink in use, as on a PCIe board), from ``nvidia-smi nvlink --status``.
    A line that is not one of these is passed over."""
    links, gpu = {}, None
    for line in (text or "")[:smi.SMI_MOST].splitlines():
        stripped = line.strip()[:smi.SMI_LINE_MOST]
        if stripped.startswith("GPU ") and ":" in stripped:
            gpu = facts.count(stripped[4:].split(":")[0])
            if gpu is not None:
                links[gpu] = ([], [])
        elif gpu is not None and stripped.startswith("Link ") and ":" in stripped:
            number, state = stripped[5:].split(":", 1)
            if facts.count(number) is not None:
                links[gpu][1 if "inactive" in state.lower() else 0].append(facts.count(number))
    return {g: down for g, (up, down) in links.items() if up and down}


def query_health(visible, nproc):
    """The health facts of the job's GPUs (facts.job_gpu_indices), each with ``nvlink_down`` where
    some of its links are; [] where there are no NVIDIA GPUs. Where the driver lists GPUs and
    nvidia-smi does not answer ("GPU is lost", no driver, a hang), one entry without an index
    names it (``failed``): the node's GPUs are then of unknown health, which refuses the launch."""
    if not facts.has_nvidia_gpus():
        return []
    text = problem = None
    for fields in (HEALTH_FIELDS, BASIC_FIELDS):
        text, problem = smi.nvidia_smi_said(["--query-gpu=" + ",".join(fields), "--format=csv"])
        if text is not None or problem == smi.HUNG % smi.NVIDIA_SMI_TIMEOUT:
            break  # a hung nvidia-smi is asked nothing more: each ask would wait as long
    if text is None:
        return [{"index": None, "failed": problem}] if problem else []  # none: no nvidia-smi to ask
    every = parse_health(text)
    if not any(isinstance(g.get("index"), int) for g in every):
        return every or [{"index": None, "failed": "nvidia-smi listed no GPU, and the driver lists some"}]
    used = facts.job_gpu_indices(visible, nproc, [g for g in every if isinstance(g.get("index"), int) and g.get("uuid")])
    gpus = [g for g in every if g.get("index") in used or not isinstance(g.get("index"), int)]
    down = parse_nvlink(smi.nvidia_smi(["nvlink", "--status"])) if len(gpus) > 1 else {}
    for gpu in gpus:
        if down.get(gpu.get("index")):
            gpu["nvlink_down"] = down[gpu["index"]]
    return gpus
