"""Who runs the next attempt (pure): which listed nodes run, which wait as spares, which are out
for now (away: until they answer again) and which for good (quarantined). attempts.py says when
the roster changes; this module says how."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace

from ..config.cluster import ClusterConfig, NodeConfig


@dataclass
class Verdict:
    go_on: bool
    notice: str | None = None


@dataclass
class Roster:
    active: list[NodeConfig]
    spares: list[NodeConfig]
    min_nodes: int
    quarantined: list[str] = field(default_factory=list)
    blamed: Counter = field(default_factory=Counter)  # times each node was an attempt's root cause
    away: list[NodeConfig] = field(default_factory=list)  # lost once: back once they answer again (rejoin)
    losses: Counter = field(default_factory=Counter)  # times each node was lost as an attempt's root cause
    just_lost: set[str] = field(default_factory=set)  # away since the attempt that just ended: not asked yet
    size: int = 0  # the nodes the run starts on: it never grows past them
    vanished: list[NodeConfig] = field(default_factory=list)  # no longer listed by `nodes_command:`

    @classmethod
    def of(cls, config: ClusterConfig) -> Roster:
        count = config.active_count
        return cls(list(config.nodes[:count]), list(config.nodes[count:]),
                   config.min_nodes if config.min_nodes is not None else count, size=count)

    def cluster(self, config: ClusterConfig) -> ClusterConfig:
        """The attempt's cluster: the active nodes in their positions (node ranks). The master
        moves to the first of them only if its own node is out."""
        nodes = tuple(replace(n, rank=i) for i, n in enumerate(self.active))
        running = {n.label for n in nodes}
        out = {a for n in (*config.nodes, *self.vanished) if n.label not in running for a in (n.addr, n.host)}
        master = nodes[0].addr if config.master_addr in out else config.master_addr
        return replace(config, nodes=nodes, master_addr=master, spares=0)

    @property
    def out(self) -> tuple[str, ...]:
        """The nodes out of the run so far: for good, and away until they answer again."""
        return (*self.quarantined, *(n.label for n in self.away))

    @property
    def replaces(self) -> bool:
        """Whether nodes are ever taken out: with spares to take their place, or min_nodes to go
        on without. Without either, every attempt runs on the nodes listed."""
        return bool(self.spares or self.quarantined or self.away) or self.min_nodes < len(self.active)

    def settle(self, cause_node: str | None, lost: bool, also_lost: tuple[str, ...] = ()) -> Verdict:
        """After a failed attempt whose root cause was on ``cause_node`` (a label), with the other
        nodes lost in it (``also_lost``). Every node lost is out of the next attempt, whatever the
        root cause was (two lost at once; a rank failing as a node drops): lost once, it is away
        and comes back when it answers again (rejoin); lost twice, or the root cause twice, it is
        out for the rest of the run."""
        self.just_lost = set()
        if not self.replaces:
            return Verdict(True)
        out: list[tuple[str, bool]] = []  # (label, lost), the root cause's first
        if cause_node is not None:
            self.blamed[cause_node] += 1
            if lost or self.blamed[cause_node] >= 2:
                out.append((cause_node, lost))
        running = {n.label for n in self.active}  # before a spare takes a place
        out += [(label, True) for label in dict.fromkeys(also_lost) if label != cause_node and label in running]
        said: list[str] = []
        for label, was_lost in out:
            verdict = self._out(label, was_lost)
            said.append(verdict.notice)
            if not verdict.go_on:
                return Verdict(False, "; ".join(said))
        return Verdict(True, "; ".join(said) or None)

    def _out(self, label: str, lost: bool) -> Verdict:
        """``label`` out: away until it answers again if lost for the first time, else for good."""
        self.losses[label] += lost
        if lost and self.losses[label] < 2:
            return self.take_out(label, away=True, why="lost")
        return self.take_out(label, away=False, why="lost twice" if lost else "the root cause twice")

    def set_aside(self, label: str) -> Verdict:
        """A node that straggled for `evict_after:` (job/pace.py): out until it answers again, as
        a node lost once; out a second time (set aside or lost), it is out for the rest of the run."""
        self.just_lost = set()
        self.losses[label] += 1
        if self.losses[label] < 2:
            return self.take_out(label, away=True, why="set aside: a straggler")
        return self.take_out(label, away=False, why="set aside after it was out once already")

    @property
    def can_spare(self) -> bool:
        """Whether the run can do without one of its nodes: a spare, or min_nodes below its size."""
        return bool(self.spares) or len(self.active) - 1 >= self.min_nodes

    def take_out(self, label: str, away: bool, why: str) -> Verdict:
        """``label`` out of the run, ``away`` (until it answers again) or for good; a spare takes
        its place, else the run goes on smaller as far as min_nodes allows, else it ends."""
        position = next(i for i, n in enumerate(self.active) if n.label == label)
        if away:
            self.away.append(self.active[position])
            self.just_lost.add(label)
            out = f"{label} is out until it answers again ({why})"
        else:
            self.quarantined.append(label)
            out = f"{label} is out for the rest of the run ({why})"
        if self.spares:
            spare = self.spares.pop(0)
            self.active[position] = spare
            return Verdict(True, f"{out}; spare {spare.label} takes its place as node {position}")
        if len(self.active) - 1 >= self.min_nodes:
            self.active.pop(position)
            return Verdict(True, f"{out}; no spare left: going on with {len(self.active)} node(s) (min_nodes: "
                                 f"{self.min_nodes}), a smaller world")
        if self.min_nodes < self.size:
            return Verdict(False, f"{out}, and no spare is left: {len(self.active) - 1} node(s) would remain, fewer than "
                                  f"min_nodes ({self.min_nodes})")
        return Verdict(False, f"{out}, and no spare is left (set `spares:`, or `min_nodes:` to go on with fewer nodes)")

    def relist(self, listed: tuple[NodeConfig, ...]) -> Verdict:
        """The nodes `nodes_command:` lists now (each with its listed settings). One no longer
        listed is out: a spare takes its place, else the run goes on smaller as far as min_nodes
        allows. One listed for the first time joins where the run is smaller than it started,
        else waits as a spare. A node out (away, quarantined) stays out as long as it was."""
        now = {n.label: n for n in listed}
        said: list[str] = []
        self.spares = [now[n.label] for n in self.spares if n.label in now]
        self.away = [n for n in self.away if n.label in now]
        for node in [n for n in self.active if n.label not in now]:
            self.vanished.append(node)
            position = self.active.index(node)
            if self.spares:
                self.active[position] = self.spares.pop(0)
                said.append(f"{node.label} is no longer listed; spare {self.active[position].label} takes its place")
            else:
                self.active.pop(position)
                said.append(f"{node.label} is no longer listed: {len(self.active)} node(s) left")
        self.active = [now[n.label] for n in self.active]
        known = {n.label for n in (*self.active, *self.spares, *self.away)} | set(self.quarantined)
        self.spares += [n for n in listed if n.label not in known]
        said += self.fill(listed, [n.label for n in listed if n.label not in known],
                          "{node} is listed now: it joins the run, which grows to {count} node(s)",
                          "{node} is listed now: it waits as a spare")
        if len(self.active) < self.min_nodes:
            return Verdict(False, "; ".join(said + [f"fewer than min_nodes ({self.min_nodes}) are listed: no new attempt"]))
        return Verdict(True, "; ".join(said) or None)

    def fill(self, listed: tuple[NodeConfig, ...], labels: list[str], joins: str, waits: str,
             leaving: tuple[str, ...] = ()) -> list[str]:
        """The spares named by ``labels`` join the run while it is smaller than it started (the
        run then in the listed order, so node ranks follow the list); what to say of each (the
        count without ``leaving``: the nodes the attempt lost, taken out next)."""
        said = []
        for node in [n for n in self.spares if n.label in labels]:
            if len(self.active) < self.size:
                self.spares.remove(node)
                order = {n.label: i for i, n in enumerate(listed)}
                self.active = sorted(self.active + [node], key=lambda n: order.get(n.label, len(order)))
                said.append(joins.format(node=node.label, count=sum(n.label not in leaving for n in self.active)))
            else:
                said.append(waits.format(node=node.label))
        return said

    def rejoin(self, answering: set[str], listed: tuple[NodeConfig, ...], leaving: tuple[str, ...] = ()) -> list[str]:
        """The away nodes that answer again come back, as spares that join at once where the run
        is smaller than it started; what to say of each (``leaving``: as fill's)."""
        back = [n for n in self.away if n.label in answering]
        self.away = [n for n in self.away if n.label not in answering]
        self.spares += back
        return self.fill(listed, [n.label for n in back],
                         "{node} answers again: it rejoins the run, which goes on with {count} node(s)" if leaving else
                         "{node} answers again: it rejoins the run, which grows back to {count} node(s)",
                         "{node} answers again: it waits as a spare", leaving)
