"""Node lists in the formats users already have: MPI/DeepSpeed hostfiles, horovod's ``-H``, and a
Slurm allocation. Pure: each returns ``[{"host": ..., "gpus": ...}]`` entries for the cluster file's
``nodes:``, so one validator checks every source alike.
"""

from __future__ import annotations

import re
from typing import Mapping

from ..errors import ConfigError, UsageError

_SLOTS = re.compile(r"slots\s*=\s*(\S+)")
MAX_HOSTS = 65536  # more than any cluster: a host list that expands past it is a typo (or an attack)
MAX_SLOTS = 4096  # processes on one node
HOST_MOST = 255  # characters of a host name (DNS's limit; an SSH config alias is shorter still)


def parse_hostfile(text: str, path: str) -> list[dict]:
    """``host slots=N`` per line (MPI, DeepSpeed); ``#`` comments; no slots means 1, as in MPI."""
    nodes = []
    for number, raw in enumerate(text.splitlines(), start=1):
        words = raw.split("#", 1)[0].split()
        if not words:
            continue
        slots = 1
        for word in words[1:]:
            found = _SLOTS.fullmatch(word)
            if found:
                slots = _count(found.group(1), lambda why: ConfigError(path, number, "slots", why))
            elif not word.startswith("max_slots="):  # an MPI upper bound: nothing to launch by
                raise ConfigError(path, number, "", f"expected `HOST slots=N`, got {raw.strip()!r}")
        why = host_problem(words[0])
        if why:
            raise ConfigError(path, number, "", f"the host {why}")
        nodes.append({"host": words[0], "gpus": slots})
        if len(nodes) > MAX_HOSTS:
            raise ConfigError(path, number, "", f"more than {MAX_HOSTS} hosts: more than any cluster")
    if not nodes:
        raise ConfigError(path, None, "", "no hosts in the hostfile (expected lines like `gpu-a slots=8`)")
    return nodes


def parse_host_list(spec: str) -> list[dict]:
    """horovod's ``-H h1:4,h2:4``; a host without ``:N`` has 1 slot; an IPv6 address in brackets,
    ``[fe80::1]:4`` (without them, ``fe80::1:4`` could be either, and is refused)."""
    nodes = []
    for item in (part.strip() for part in spec.split(",")):
        host, slots = _host_and_slots(item, spec)
        why = host_problem(host)
        if why:
            raise UsageError(f"-H {item!r}: the host {why}")
        nodes.append({"host": host, "gpus": _count(slots, lambda why: UsageError(f"-H {item!r}: {why}"))})
    return nodes


def _host_and_slots(item: str, spec: str) -> tuple[str, str]:
    if item.startswith("["):
        host, close, rest = item[1:].partition("]")
        if close and (rest == "" or rest.startswith(":")) and host:
            return host, rest[1:] or "1"
    elif item.count(":") > 1:
        raise UsageError(f"-H {item!r}: write an IPv6 address in brackets, e.g. -H [fe80::1]:8")
    else:
        host, _, slots = item.rpartition(":") if ":" in item else (item, "", "1")
        if host:
            return host, slots
    raise UsageError(f"-H {spec!r}: expected HOST:N[,HOST:N...], e.g. -H gpu-a:8,gpu-b:8")


def host_problem(host: str) -> str | None:
    """Why ``host`` cannot name a node (to ssh, srun and the other nodes), or None: an address, a
    DNS name or an SSH config alias has no spaces or control characters and does not start with
    '-' (ssh would read it as an option)."""
    if not host:
        return "is empty"
    if any(c.isspace() or not c.isprintable() for c in host):
        return f"{host!r} has a space or a control character"
    if host.startswith("-"):
        return f"{host!r} starts with '-'"
    if len(host) > HOST_MOST:
        return f"{host[:40]!r}... is {len(host)} characters long, more than any host name ({HOST_MOST})"
    return None


def _count(text: str, error) -> int:
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= MAX_SLOTS:
        raise error(f"slots must be an integer from 1 to {MAX_SLOTS}, got {text!r}")
    return int(text)


# --- Slurm ---------------------------------------------------------------------------------------

def expand_hostlist(spec: str) -> list[str]:
    """Slurm's compressed host list: ``gpu[01-03,07],cpu1`` -> gpu01 gpu02 gpu03 gpu07 cpu1.
    Zero padding is kept; several bracket groups in one name expand as a product."""
    hosts: list[str] = []
    for name in _split_top_level(spec):
        hosts.extend(_expand_name(name, spec, MAX_HOSTS - len(hosts)))
    return hosts


def _split_top_level(spec: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for c in spec:
        depth += (c == "[") - (c == "]")
        if depth < 0 or depth > 1:
            raise UsageError(f"bad Slurm host list {spec!r}: unbalanced brackets")
        if c == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += c
    if depth:
        raise UsageError(f"bad Slurm host list {spec!r}: unbalanced brackets")
    return [p for p in [*parts, current] if p]


def _expand_name(name: str, spec: str, room: int) -> list[str]:
    """``name``'s hosts; UsageError once they would pass ``room`` (checked before expanding, so
    ``node[1-999999999]`` costs nothing)."""
    group = re.search(r"\[([^\]]*)\]", name)
    if not group:
        return [name]
    head, tail = name[:group.start()], name[group.end():]
    out: list[str] = []
    for piece in group.group(1).split(","):
        low, _, high = piece.partition("-")
        if not _digits(low) or (high and not _digits(high)) or (high and int(high) < int(low)):
            raise UsageError(f"bad Slurm host range [{group.group(1)}] in {name!r}")
        if int(high or low) - int(low) + 1 > room - len(out):
            raise UsageError(f"Slurm host list {spec[:80]!r} expands to more than {MAX_HOSTS} hosts")
        for n in range(int(low), int(high or low) + 1):
            out.extend(_expand_name(f"{head}{n:0{len(low)}d}{tail}", spec, room - len(out)))
    return out


def _digits(text: str) -> bool:
    return text.isascii() and text.isdigit() and len(text) <= 9


def slurm_nodes(env: Mapping[str, str]) -> tuple[list[dict], int]:
    """(nodes, master port) from the variables Slurm sets inside an allocation. GPUs per node come
    from the allocation (SLURM_GPUS_ON_NODE, SLURM_GPUS_PER_NODE, else tasks per node); the port is
    15000 + the job id's last 4 digits, as Slurm helper scripts derive it."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not nodelist or not job_id:
        raise UsageError("--slurm: not inside a Slurm allocation (SLURM_JOB_NODELIST / SLURM_JOB_ID are not "
                         "set); run it from sbatch or salloc")
    gpus = _slurm_gpus(env)  # None: the allocation says no count, and the settings file's `gpus:` (else auto) holds
    nodes = [{"host": host} if gpus is None else {"host": host, "gpus": gpus} for host in expand_hostlist(nodelist)]
    digits = re.sub(r"\D", "", job_id)[-4:]
    return nodes, 15000 + int(digits or 0)


SLURM_COUNT = re.compile(r"[0-9]{1,4}")  # a count Slurm sets: ASCII digits, and no node runs 10,000 processes


def _slurm_gpus(env: Mapping[str, str]) -> int | None:
    """The processes a node of the allocation runs, or None where the allocation gives no count."""
    for key, value in (("SLURM_GPUS_ON_NODE", env.get("SLURM_GPUS_ON_NODE", "")),
                       ("SLURM_GPUS_PER_NODE", env.get("SLURM_GPUS_PER_NODE", "").rsplit(":", 1)[-1]),  # "a100:4"
                       ("SLURM_NTASKS_PER_NODE", env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0])):  # "4(x2)"
        if value and not SLURM_COUNT.fullmatch(value):
            raise UsageError(f"--slurm: {key}={env.get(key, '')[:40]!r} is not a count of processes per node; set "
                             "`gpus:` in the settings file (CLUSTER.yaml) instead")
        if value and int(value) > 0:
            return int(value)
    return None
