"""Stage 0, the code that runs on the nodes: the node agent, as a stdlib-only package (Python 3.8+).
It imports nothing of the controller's; every stage of the controller may import it (protocol's
wire, the protocol's vocabulary, and policy, the decisions both ends make, most of all).

The controller ships these modules to every node over the agent's stdin, as source and as
bytecode (see remote/protocol.py); the loader (boot.py) builds this package there under the name
``ddp_up_node``, rooms and all, so relative imports work the same on the controller
(``orchestrator.node.*``) and on a node.

The house is its rooms, one role each, in ROOMS' order: a room imports only rooms before it (a
test holds it, as it holds the controller's stages), and its ``__init__`` says what it does.

  userpython  code that runs in the user's Python, not the agent's: the warm interpreter (before
              the fork: beforefork; in the parent: warmparent; in the child: inchild), torchrun's
              stand-in (standin), every rank's hook (rankhook), the preflight's torch probe
              (torchprobe), a name in ps (proctitle), the names both sides share (names); stdlib
              only, shipped as files and run from them (local/ourcode.py)
  protocol    what both ends agree on: the frames (wire), the decisions (policy, stragglers), events
  local       processes and private state: tags, find and kill (procs), records and journals
              (state), the state root whole (inventory), the userpython room as files (ourcode)
  probes      what the node is: network and GPUs (facts, nvidia-smi asked by smi), their health (gpuhealth)
  files       files in and out: the workdir copy (sync), ddp-fetch (fetch)
  watch       an attempt's processes watched: output (relay, screen), stacks, collectives (flight),
              how each rank ended (teardown, failures, report), a function's return values (results)
  launchers   an attempt's processes started: warm (warm; a session's: keptwarm), ddp-up's own
              (workers), in an image (container, image, keptbox; boxwarm and boxkeep run in it)
  attempt     an attached run: preflight (checks), where and with what the launcher starts
              (placement), one attempt (launch), the run's events (inbox), its warm interpreters
              (warmline), run mode (run), keep mode (keep)
  supervise   a detached job: its run (detached), between attempts (restarts), its supervisor
              (supervisor, its ears: hearing, its watch: watching, its record: ledger; door: where
              the agents meet), its decisions (decide; members: an elastic job's nodes), notices
              (notify), its journal (replay)

Its own modules, above every room: main (the table from spec frame to mode, and the agent's
name in ps), oneshot (detect and sweep modes) and boot (the loader that builds the package on a
node: run from stdin, never imported).

SHIPPED is the one list of what is shipped, in the order the loader runs them: each module comes
after every module it imports. IN_IMAGE are node modules no agent runs: a container's first
process runs them in the image, sent with the job (RunSpec.box_code, container.BOX_MAIN), with
the shipped modules they import.
"""

import re
from functools import lru_cache
from pathlib import Path

ROOMS = {  # each room's modules, in the order they import each other
    "userpython": ("names", "proctitle", "beforefork", "inchild", "warmparent", "standin", "rankhook", "torchprobe"),
    "protocol": ("wire", "policy", "stragglers", "events"),
    "local": ("ourcode", "procs", "state", "inventory"),
    "probes": ("smi", "facts", "gpuhealth"),
    "files": ("sync", "fetch"),
    "watch": ("report", "teardown", "flight", "screen", "relay", "failures", "stacks", "results"),
    "launchers": ("warm", "keptwarm", "workers", "container", "image", "keptbox"),
    "attempt": ("checks", "placement", "launch", "warmline", "inbox", "run", "keep"),
    "supervise": ("members", "decide", "notify", "watching", "door", "peers", "hearing", "ledger", "supervisor", "peerlink", "restarts", "detached", "replay"),
}
HOUSE = ("oneshot", "main")  # the package's own modules, after every room
SHIPPED = tuple("%s.%s" % (room, name) for room, names in ROOMS.items() for name in names) + HOUSE
IN_IMAGE = ("launchers.boxwarm", "launchers.boxkeep")
PACKAGE = "ddp_up_node"  # the package's name on a node


# A module's imports of the house's modules, read from its source as text (parsing them all would
# cost every command a tenth of a second); a unit test holds this to the parsed imports.
_IMPORTS = re.compile(rb"^[ \t]*from (\.+)([\w.]*) import \(?([\w, ]+)", re.M)
_KNOWN = frozenset(SHIPPED + IN_IMAGE)


def path(name):
    """The file of the house's module ``name`` (dotted, as in SHIPPED)."""
    return Path(__file__).parent.joinpath(*name.split(".")).with_suffix(".py")


@lru_cache(maxsize=None)
def source(name):
    """The source of the house's module ``name``, as bytes (read once)."""
    return path(name).read_bytes()


def imports(name):
    """The house's modules (dotted) that module ``name`` imports, at the top or inside a function."""
    found = set()
    for dots, module, names in _IMPORTS.findall(source(name)):
        base = name.split(".")[:-len(dots)]
        target = ".".join(base + ([module.decode()] if module else []))
        named = {".".join(filter(None, (target, n.strip().decode()))) for n in names.split(b",") if n.strip()}
        found |= {target} if target in _KNOWN else named & _KNOWN
    return found


def needs(*names):
    """``names`` and every module of the house they import, in SHIPPED's order (then IN_IMAGE's)."""
    wanted, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name not in wanted:
            wanted.add(name)
            todo += imports(name)
    return tuple(name for name in SHIPPED + IN_IMAGE if name in wanted)
