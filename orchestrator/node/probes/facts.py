"""What a node's agent finds out about the node's network and GPUs: stdlib only, shipped to every
node with the agent (as ``ddp_up_node.probes.facts``, see node/boot.py).

Reading the system (``read_*``, ``query_*``) is kept apart from parsing and deciding (everything
else), so the deciding half is unit-tested on the controller with recorded /proc files and
nvidia-smi output, and gets the same answers there as on a node.

The interface rule: gloo and NCCL pick an interface themselves when nobody names one,
from what the node's hostname resolves to (gloo) or the first interface up that is not loopback or
docker (NCCL). On real clusters that is often one the other nodes cannot reach (a management NIC,
docker0, 127.0.1.1). The route the kernel itself takes to the master's address is the one that
works, so that interface is what ddp-up names, unless the user named one.
"""

import math
import os
import socket
import struct

from .smi import SMI_LINE_MOST, SMI_MOST, nvidia_smi

IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


# --- the route to the master ---------------------------------------------------------------------

def source_address(addr):
    """The local address the kernel would use to reach ``addr`` (a UDP connect sends nothing),
    or None when there is no route at all."""
    try:
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((addr, 9))
            return s.getsockname()[0]
    except (OSError, ValueError):
        return None


def read_interface_addresses():
    """{interface: [addresses]} of this node: each interface's primary IPv4 address (an ioctl;
    /proc has no per-interface IPv4 list), and IPv6 from /proc/net/if_inet6."""
    found = {}
    for _, name in _interfaces():
        v4 = _ipv4_of(name)
        if v4:
            found.setdefault(name, []).append(v4)
    try:
        with open("/proc/net/if_inet6") as f:
            for name, addr in parse_if_inet6(f.read()):
                found.setdefault(name, []).append(addr)
    except OSError:
        pass
    return found


def _interfaces():
    try:
        return socket.if_nameindex()
    except (OSError, AttributeError):
        return []


def _ipv4_of(name):
    """The interface's primary IPv4 address (SIOCGIFADDR), or None."""
    try:
        import fcntl
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
        return socket.inet_ntoa(raw[20:24])
    except (ImportError, OSError):
        return None


def parse_if_inet6(text):
    """(interface, address) pairs from /proc/net/if_inet6."""
    pairs = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 6 and len(parts[0]) == 32:
            raw = bytes.fromhex(parts[0])
            pairs.append((parts[5], socket.inet_ntop(socket.AF_INET6, raw)))
    return pairs


def parse_routes(text):
    """(interface, destination, mask, metric) of each IPv4 route in /proc/net/route: the address
    bytes in network order, printed as the host's integer of them (so compared as _as_kernel_int)."""
    routes = []
    for line in text.splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 8:
            try:
                routes.append((parts[0], int(parts[1], 16), int(parts[7], 16), int(parts[6])))
            except ValueError:
                continue
    return routes


def _as_kernel_int(addr):
    return struct.unpack("=I", socket.inet_aton(addr))[0]


def routed_interfaces(addr, routes):
    """The interfaces with an IPv4 route that covers ``addr``, the most specific first."""
    try:
        target = _as_kernel_int(addr)
    except OSError:
        return []
    covering = [(bin(mask).count("1"), -metric, name) for name, dest, mask, metric in routes
                if target & mask == dest]
    ordered = [name for _, _, name in sorted(covering, reverse=True)]
    return [name for i, name in enumerate(ordered) if name not in ordered[:i]]


def interface_holding(addr, addresses):
    """The interface that has ``addr`` as one of its own addresses, or None."""
    for name, addrs in addresses.items():
        if addr in addrs:
            return name
    return None


def interfaces_reaching(addr, addresses, routes):
    """The interfaces a process here can reach ``addr`` through: the one that holds it (the
    master's own node), else every interface with a route that covers it."""
    holder = interface_holding(addr, addresses)
    return [holder] if holder else routed_interfaces(addr, routes)


def route_to(addr, addresses, routes):
    """(interface, source address) this node uses to reach ``addr``: the kernel's own choice of
    source, and the interface that holds that source; (None, None) without a route."""
    source = source_address(addr)
    if source is None:
        return None, None
    holder = interface_holding(addr, addresses)
    if holder:  # the master's own node: its address is the one the others reach
        return holder, addr
    name = interface_holding(source, addresses)
    if name is None or name == "lo" and not addr.startswith("127."):
        routed = routed_interfaces(addr, routes)
        name = routed[0] if routed else name
    return name, source


# --- explicit settings ---------------------------------------------------------------------------

def selected_interfaces(var, value, names):
    """The interfaces of ``names`` a GLOO_/NCCL_SOCKET_IFNAME value selects, in ``names`` order.
    gloo: exact names, comma separated. NCCL: prefixes, ``=`` for exact names, ``^`` to exclude."""
    wanted = [w.strip() for w in value.split(",") if w.strip()]
    if var.startswith("GLOO"):
        return [n for n in wanted if n in names]
    exclude = value.startswith("^")
    body = value[1:] if exclude else value
    exact = body.startswith("=")
    body = body[1:] if exact else body
    parts = [p.strip() for p in body.split(",") if p.strip()]

    def match(name):
        return any(name == p if exact else name.startswith(p) for p in parts)
    return [n for n in names if match(n) != exclude]


def ifname_problem(var, value, names, reaching):
    """Why an explicit ``var=value`` cannot carry the job's traffic to the master, or None.
    gloo uses every interface it names, so each must exist and reach the master; NCCL uses the
    ones it selects, so one that reaches the master is enough."""
    chosen = selected_interfaces(var, value, names)
    if var.startswith("GLOO"):
        missing = [w for w in value.split(",") if w and w not in names]  # as gloo reads them: spaces count
        if missing:
            shown = missing[0] if missing[0].strip() == missing[0] else repr(missing[0])  # a stray space, shown
            return "names interface %s, which this node does not have" % shown
        cut_off = [n for n in chosen if n not in reaching]
        if cut_off:
            return "interface %s has no route to the master" % cut_off[0]
        return None
    if not chosen:
        return "selects no interface of this node"
    if not any(n in reaching for n in chosen):
        return "selects %s, with no route to the master" % ", ".join(chosen)
    return None


def check_ifnames(env, names, reaching):
    """{var: value} set by the user (the job's environment), and [var, value, why] for each that
    cannot reach the master."""
    explicit = {var: env[var] for var in IFNAME_VARS if env.get(var)}
    bad = [[var, value, why] for var, value in explicit.items()
           for why in [ifname_problem(var, value, names, reaching)] if why]
    return explicit, bad


def hostname_address():
    """(hostname, the address it resolves to) as gloo would look it up; the address is None when
    it does not resolve."""
    name = socket.gethostname()
    try:
        return name, socket.getaddrinfo(name, None, socket.AF_UNSPEC, socket.SOCK_STREAM)[0][4][0]
    except (OSError, IndexError):
        return name, None


def resolve(addr):
    """``addr`` as this node resolves it (master.addr may be a name), or itself if it does not."""
    try:
        return socket.getaddrinfo(addr, None, socket.AF_UNSPEC, socket.SOCK_STREAM)[0][4][0]
    except (OSError, IndexError, UnicodeError):
        return addr


def network_facts(master_addr, env):
    """Everything the Probe answer says about this node's interfaces (see wire.Probed)."""
    master_addr = resolve(master_addr)
    addresses = read_interface_addresses()
    try:
        with open("/proc/net/route") as f:
            routes = parse_routes(f.read())
    except OSError:
        routes = []
    iface, source = route_to(master_addr, addresses, routes)
    explicit, bad = check_ifnames(env, [n for _, n in _interfaces()] or list(addresses),
                                  interfaces_reaching(master_addr, addresses, routes))
    hostname, resolves = hostname_address()
    return dict(iface=iface, source=source, explicit=explicit, bad=bad, hostname=hostname, resolves=resolves,
                resolves_iface=interface_holding(resolves, addresses) if resolves else None)


# --- GPUs ------------------------------------------------------------------------------------------

APPS_QUERY = ["--query-compute-apps=gpu_uuid,pid,used_memory,process_name", "--format=csv,noheader,nounits"]
GPUS_QUERY = ["--query-gpu=index,uuid,utilization.gpu,memory.used,memory.total", "--format=csv,noheader,nounits"]


def count(text, most=7):
    """A count or index as nvidia-smi writes one: ASCII digits only (not ², not ٣), at most ``most``
    of them; None otherwise."""
    text = text.strip()
    return int(text) if 0 < len(text) <= most and text.isascii() and text.isdigit() else None


def number(text):
    """A number as nvidia-smi writes one (units dropped by nounits), to an int; None where it is
    not one that fits: [N/A], inf, nan, 1e400, a thousand digits."""
    text = text.strip()
    if not text or len(text) > 32 or not text.isascii():
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return int(value) if math.isfinite(value) and abs(value) < 1e15 else None


def csv_rows(text):
    """nvidia-smi's CSV, row by row, each a list of fields: it neither quotes nor escapes, so a
    line is split at its commas and nothing else (a quote is text). A line too long to be one of
    the driver's is one field that says so (a row no query's columns match). Linear in the text,
    and bounded."""
    for line in (text or "")[:SMI_MOST].splitlines():
        if len(line) > SMI_LINE_MOST:
            yield ["<a line of %d characters>" % len(line)]
        elif line.strip():
            yield [field.strip() for field in line.split(",")]


def parse_gpus(text):
    """[{"index", "uuid", "util", "used", "total"}] from GPUS_QUERY output (MiB, percent; None
    where the driver says [N/A]). A row that is not five fields with an index and a uuid is left out."""
    gpus = []
    for row in csv_rows(text):
        if len(row) == 5 and count(row[0]) is not None and row[1]:
            gpus.append(dict(index=count(row[0]), uuid=row[1], util=number(row[2]),
                             used=number(row[3]), total=number(row[4])))
    return gpus


def parse_apps(text):
    """[{"uuid", "pid", "mib", "name"}] from APPS_QUERY output (the process's name may hold commas)."""
    apps = []
    for row in csv_rows(text):
        if len(row) >= 3 and row[0] and count(row[1], most=10) is not None:
            apps.append(dict(uuid=row[0], pid=count(row[1], most=10), mib=number(row[2]),
                             name=",".join(row[3:]).strip()))
    return apps


def visible_ids(visible):
    """The devices a CUDA_VISIBLE_DEVICES value names, in its order: CUDA ignores everything
    from a -1 on, and empty entries."""
    ids = [d.strip() for d in visible.split(",")]
    return [d for d in (ids[:ids.index("-1")] if "-1" in ids else ids) if d]


def job_gpu_indices(visible, nproc, gpus):
    """The indices (nvidia-smi's) of the GPUs a job of ``nproc`` processes per node uses: the
    first ``nproc`` of CUDA_VISIBLE_DEVICES (indices or UUIDs) when set, else of all GPUs."""
    ids = [str(g["index"]) for g in gpus] if visible is None else visible_ids(visible)
    ids = ids[:nproc] if nproc else ids
    by_uuid = {g["uuid"]: g["index"] for g in gpus}
    chosen = []
    for d in ids:
        if d.isdigit():
            chosen.append(int(d))
        else:  # a UUID, or its unique prefix (GPU-1a2b...), as CUDA accepts
            chosen += [i for u, i in by_uuid.items() if u.startswith(d)][:1]
    return chosen


def busy_gpus(gpus, apps, used_indices, owner_of):
    """Processes holding memory on the GPUs the job will use: [{"gpu", "pid", "user", "cmd",
    "mib"}]. ``owner_of(pid)`` -> (user, command); processes in another PID namespace may show
    as unknown, and still count."""
    index_of = {g["uuid"]: g["index"] for g in gpus}
    return [holder(app, index_of[app["uuid"]], owner_of) for app in apps
            if index_of.get(app["uuid"]) in used_indices]


def holder(app, gpu, owner_of):
    """One process holding GPU memory, as busy_gpus lists it: {"gpu", "pid", "user", "cmd", "mib"}."""
    user, cmd = owner_of(app["pid"])
    return dict(gpu=gpu, pid=app["pid"], user=user, cmd=cmd or app["name"], mib=app["mib"])


def process_owner(pid):
    """(user name or uid, command line) of ``pid``, or ("?", "") when it cannot be read here."""
    try:
        uid = os.stat("/proc/%d" % pid).st_uid
    except OSError:
        return "?", ""
    try:
        import pwd
        user = pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        user = str(uid)
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            cmd = f.read(300).replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except OSError:
        cmd = ""
    return user, cmd


def has_nvidia_gpus():
    return os.path.isdir("/proc/driver/nvidia/gpus")


def query_busy_gpus(visible, nproc):
    """The busy_gpus of this node, or [] where there are no NVIDIA GPUs or no nvidia-smi."""
    if not has_nvidia_gpus():
        return []
    gpus = parse_gpus(nvidia_smi(GPUS_QUERY))
    apps = parse_apps(nvidia_smi(APPS_QUERY))
    return busy_gpus(gpus, apps, job_gpu_indices(visible, nproc, gpus), process_owner)


def query_usage():
    """[[index, util %, used MiB, total MiB]] for the dashboard, or None without GPUs."""
    text = nvidia_smi(GPUS_QUERY) if has_nvidia_gpus() else None
    return [[g["index"], g["util"], g["used"], g["total"]] for g in parse_gpus(text)] if text else None


def count_gpus(env):
    """GPUs the job would see: CUDA_VISIBLE_DEVICES in its environment if set, else the driver's list."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len(visible_ids(visible))
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0
