"""ddp-fetch: files back from the nodes, during a run or after it (the copy itself is fetch.py's)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from rich.filesize import decimal as human_bytes
from rich.text import Text

from ..clean import outside
from ..errors import EXIT_OK, EXIT_SETUP, EXIT_USAGE, Interrupted, UsageError
from ..remote import signals
from ..remote.fetch import Fetched, destinations, fetch_all
from .common import EVERY_JOB, Parser, add_node_sources, interrupted, load_or_report, report, ssh_connections, table_console


def fetch_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="ddp-fetch",
        description="Copy a file or folder from the nodes to this machine, during a run or after it: from every "
                    "node into LOCAL_DIR/<node>/, or from one (--node) into LOCAL_DIR. Only what changed is sent "
                    "again; links come back as links, never followed; nothing here is deleted.")
    p.add_argument("cluster", metavar="CLUSTER.yaml", nargs="?", help="the cluster file (optional with a node option)")
    p.add_argument("remote", metavar="REMOTE_PATH", help="on each node: relative to its workdir, or absolute")
    p.add_argument("local", metavar="LOCAL_DIR", help="where the copies go (made if missing)")
    p.add_argument("--node", metavar="NODE", help="only this node (its host, label or index), straight into LOCAL_DIR")
    p.add_argument("--json", action="store_true", help="one JSON object per node, for scripts")
    add_node_sources(p)
    return p


def main_fetch(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = fetch_parser().parse_args(argv)
    if args.local is None and args.cluster is not None:  # `-H a:1 REMOTE LOCAL`: no cluster file
        args.cluster, args.remote, args.local = None, args.cluster, args.remote
    config = load_or_report(args, "ddp-fetch", forward=False, jobs=EVERY_JOB)
    if config is None:
        return EXIT_USAGE
    try:
        nodes = chosen(list(config.nodes), args.node)
        if not args.remote.strip() or "\0" in args.remote:
            raise UsageError(f"REMOTE_PATH {args.remote!r}: a path on the nodes, relative to the workdir or absolute")
        destinations(nodes, args.remote, per_node=args.node is None)  # refused before anything is made
        os.makedirs(args.local, exist_ok=True)
    except UsageError as e:
        return report("ddp-fetch", e)
    except OSError as e:
        return report("ddp-fetch", UsageError(f"cannot make {args.local}: {e.strerror or e}: choose a folder you can "
                                              "write to"))
    with signals.recording(), ssh_connections():
        try:
            fetched = fetch_all(nodes, args.remote, args.local, per_node=args.node is None)
        except Interrupted as e:
            return interrupted("ddp-fetch", e, "while copying; what arrived whole is kept, no partial file is left")
    show(fetched, args.json)
    return EXIT_SETUP if any(f.problem for f in fetched) else EXIT_OK


def chosen(nodes: list, which: str | None) -> list:
    """Every node, or the one ``which`` names (its label, host or index)."""
    if which is None:
        return nodes
    found = [n for n in nodes if which in (n.label, n.host, str(n.rank))]
    if not found:
        raise UsageError(f"--node {which!r}: no such node; the nodes are "
                         f"{', '.join(f'{n.rank} ({n.label})' for n in nodes[:8])}{' ...' if len(nodes) > 8 else ''}")
    return found[:1]


def show(fetched: list[Fetched], as_json: bool) -> None:
    from rich.table import Table

    console = table_console()
    if as_json:
        for f in fetched:
            print(json.dumps(f.as_dict()))
        return
    table = Table(title="ddp-fetch", title_justify="left")
    for column in ("node", "into", "copied", "bytes", "unchanged", "links"):
        table.add_column(column, no_wrap=True)
    for f in fetched:
        table.add_row(outside(f.node), outside(f.dest), str(f.files), human_bytes(f.bytes), str(f.unchanged),
                      str(f.links))
    console.print(table)
    for f in fetched:
        for what in f.left_out[:10]:
            console.print(outside(f"{f.node}: left out {what}"))
        if f.changed:
            console.print(outside(f"{f.node}: {len(f.changed)} file(s) changed on the node while they were copied "
                                  f"(fetch again for their newer state): {', '.join(f.changed[:5])}"))
        if f.problem:
            first, *rest = f.problem.render().splitlines()
            console.print(Text("✗ ", style="bold red") + outside(first))
            for line in rest:
                console.print(outside(line))
