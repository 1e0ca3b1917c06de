"""What to say of a cluster-file key that is not allowed where it stands: where it belongs, our
word for another launcher's, or a near spelling. The validator's own table of keys stays in
validate.py; this is only the hint."""

from __future__ import annotations

import difflib

# Keys users bring from elsewhere: ssh:'s keys at the top level, a node's keys outside `nodes:`,
# and torchrun's, DeepSpeed's and accelerate's words for ours. Each says where it goes instead.
SSH_KEY_HINT = "belongs under `ssh:` (for every node) or on a node"
OTHER_WORDS = {
    "nproc_per_node": "is `gpus:` here (processes per node, at the top level or on a node)",
    "nproc-per-node": "is `gpus:` here (processes per node, at the top level or on a node)",
    "num_gpus": "is `gpus:` here (processes per node, at the top level or on a node)",
    "slots": "is `gpus:` here (processes per node, at the top level or on a node)",
    "hosts": "is `nodes:` here: a list of `- host: NAME` entries",
    "hostfile": "is a command-line option here: ddp-up --hostfile FILE CLUSTER.yaml SCRIPT",
    "nnodes": "is not needed: the nodes are counted from `nodes:`",
    "num_machines": "is not needed: the nodes are counted from `nodes:`",
    "node_rank": "is not needed: each node's rank is its place in `nodes:`",
    "machine_rank": "is not needed: each node's rank is its place in `nodes:`",
    "master_addr": "is `master: {addr: ...}` here",
    "main_process_ip": "is `master: {addr: ...}` here",
    "master_port": "is `master: {port: ...}` here",
    "main_process_port": "is `master: {port: ...}` here",
}
NODE_ONLY_HINTS = {"host": "belongs on a node: `nodes: [{host: NAME}]`",
                   "addr": "belongs on a node (the address other nodes use for it) or under `master:`"}


def unknown_key_hint(key: str, at: tuple, allowed: tuple[str, ...], ssh_keys: tuple[str, ...]) -> str:
    """What to say of a key that is not allowed at ``at``: where it belongs, our word for another
    launcher's, a near spelling, or the keys allowed there."""
    if key in OTHER_WORDS:
        return f"`{key}` " + OTHER_WORDS[key]
    if not at:  # the top level
        if key in ssh_keys:
            return f"`{key}` " + SSH_KEY_HINT
        if key in NODE_ONLY_HINTS:
            return f"`{key}` " + NODE_ONLY_HINTS[key]
    hint = _closest(key, allowed)
    return f"did you mean `{hint}`?" if hint else f"allowed here: {', '.join(allowed)}"


def _closest(word: str, options: tuple[str, ...]) -> str | None:
    match = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return match[0] if match else None
