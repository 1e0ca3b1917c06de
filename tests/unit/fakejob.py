"""Fakes that drive the real Job loop in milliseconds: a fake clock, a queue on that clock, node
sessions that answer like agents (or, per test, do not), a sweeper and a view that record."""

from __future__ import annotations

import queue
from signal import SIGINT
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable

from orchestrator.node.protocol import wire
from orchestrator.remote.channel import ChannelEnd
from orchestrator.config.clusterfile import parse_cluster
from orchestrator.job.events import Closed, Lines, LogLine, Message
from orchestrator.job.loop import Job
from orchestrator.plan.launch import make_plan
from orchestrator.remote.signals import SignalInbox

READY = dict(python="3.11", torch="2.13.0", cuda=None, nccl=None, gpus=0, disk_free=1 << 30)
HORIZON = 3600.0  # fake seconds: a job loop still running then is stuck, and the test fails


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeQueue:
    """The job's event queue on the fake clock: an event that is due comes out at once, else
    ``get`` lets time pass up to its timeout (or the next scheduled event) and says Empty."""

    def __init__(self, clock: Clock):
        self.clock = clock
        self.ready: deque = deque()
        self.scheduled: list[tuple[float, int, object]] = []
        self._order = 0

    def put(self, event: object) -> None:
        self.ready.append(event)

    def at(self, when: float, event: object | Callable[[], None]) -> None:
        """Post ``event`` (or run it, if callable) once the clock reaches ``when``."""
        self._order += 1
        self.scheduled.append((when, self._order, event))
        self.scheduled.sort(key=lambda item: item[:2])

    def get(self, timeout: float) -> object:
        if self.clock.now > HORIZON + 1000.0:
            raise AssertionError("the job loop is still running after an hour of fake time")
        self._release_due()
        if self.ready:
            return self.ready.popleft()
        step = timeout if timeout > 0 else 0.001
        if self.scheduled:
            step = min(step, max(0.0, self.scheduled[0][0] - self.clock.now))
        self.clock.now += step
        self._release_due()
        if self.ready:
            return self.ready.popleft()
        raise queue.Empty

    def _release_due(self) -> None:
        while self.scheduled and self.scheduled[0][0] <= self.clock.now:
            _, _, event = self.scheduled.pop(0)
            if callable(event):
                event()
            else:
                self.ready.append(event)


@dataclass
class FakeNode:
    """A node session whose agent does what a healthy agent does, unless told otherwise."""

    index: int
    post: Callable[[object], None]
    clock: Clock
    master: bool = False
    connects: bool = True  # False: stuck connecting (an unreachable host)
    obeys_stop: bool = True  # False: workers ignore SIGTERM (only Kill ends them)
    obeys_kill: bool = True  # False: the agent hangs (only a sweep helps)
    exit_code: int | None = None  # after Go: exit by itself with this code at run_for seconds
    run_for: float = 10.0
    failures: list | None = None  # its ranks' own failures, in every Exited (node/watch/failures.py's form)
    queue: FakeQueue | None = None
    on_send: Callable[[wire.Frame], None] | None = None  # a test's hook, called before the reaction
    sent: list[wire.Frame] = field(default_factory=list)
    probed: dict = field(default_factory=dict)  # more of the Probed answer: the node's interfaces
    ready: dict = field(default_factory=dict)  # more of the Ready report: others' processes on its GPUs
    silent_since: float | None = None
    first_word_after: float = 0.0  # its agent's start takes this long (a loaded node, a slow `setup:`)
    heard: bool = False
    started: bool = False
    cancelled: bool = False
    closed: bool = False

    @property
    def last_heard(self) -> float:
        return self.clock() if self.silent_since is None else self.silent_since

    def say(self, frame: wire.Frame) -> None:
        self.post(Message(self.index, frame))
        if isinstance(frame, wire.Exited):  # then the agent exits, and its channel ends
            self.post(Closed(self.index, ChannelEnd(exit_status=0, stderr_tail=())))

    def open(self) -> None:
        if not self.connects:
            return
        self.started = True
        if self.first_word_after and not self.heard:
            self.silent_since = self.clock()
            self.queue.at(self.clock() + self.first_word_after, self.first_word)
            return
        self.heard = True
        self.say(wire.Ready(hostname=f"n{self.index}", time=self.clock(), port=29500 if self.master else None,
                            **{**READY, **self.ready}))

    def first_word(self) -> None:
        self.silent_since, self.first_word_after = None, 0.0
        self.open()

    def send(self, frame: wire.Frame) -> None:
        self.sent.append(frame)
        if self.on_send is not None:
            self.on_send(frame)
        if self.closed or self.silent_since is not None:
            return
        if isinstance(frame, wire.Probe):
            self.say(wire.Probed(ok=True, **self.probed))
        elif isinstance(frame, wire.Go):
            self.say(wire.Started())
            if self.exit_code is not None:
                self.queue.at(self.clock() + self.run_for, lambda: self.say(wire.Exited(
                    code=self.exit_code, signal=None, stopped=False, reason=None, failures=self.failures)))
        elif isinstance(frame, wire.Stop):
            self.say(wire.Stopping(reason="stopped by ddp-up"))
            if self.obeys_stop:
                self.say(wire.Exited(code=-15, signal="SIGTERM", stopped=True, reason="stopped by ddp-up",
                                     failures=self.failures))
        elif isinstance(frame, wire.Kill) and self.obeys_kill:
            self.say(wire.Exited(code=-9, signal="SIGKILL", stopped=True, reason="stopped by ddp-up"))

    def kinds(self) -> list[str]:
        return [type(f).__name__ for f in self.sent if not isinstance(f, wire.Heartbeat)]

    def cancel(self) -> None:
        self.cancelled = True

    def close(self) -> None:
        self.closed = True

    def disconnect(self, wait: bool = True) -> None:
        self.closed = True
        self.waited = wait


class FakeSweeper:
    def __init__(self) -> None:
        self.swept: list[str] = []

    def start(self, node) -> None:
        self.swept.append(node.label)

    def finish(self) -> list:
        return []


class RecordingView:
    def __init__(self) -> None:
        self.notices: list[str] = []
        self.states: list[tuple[str, str]] = []
        self.lines_seen: list[LogLine] = []
        self.bars_seen: list = []
        self.gpus_seen: list = []
        self.late_seen: list = []
        self.events: list[tuple[str, str, dict]] = []

    def lines(self, node, lines) -> None:
        self.lines_seen.extend(lines)

    def bars(self, node, bars, at=None) -> None:
        self.bars_seen.extend(bars)

    def gpus(self, node, gpus, at=None) -> None:
        self.gpus_seen.append((node.label, gpus))

    def late(self, figures) -> None:
        self.late_seen.append(tuple(figures))

    def event(self, kind: str, text: str, **fields) -> None:
        self.events.append((kind, text, fields))

    def node_state(self, status) -> None:
        self.states.append((status.plan.label, status.state))

    def notice(self, text: str) -> None:
        self.notices.append(text)

    def tick(self, snapshot) -> None:
        snapshot()  # the dashboard's path: building a snapshot must work in every state


class Harness:
    """A Job over ``n`` fake nodes (node 0 is the master), with everything recorded."""

    def __init__(self, n: int = 2, gpus: int = 1, replan: dict | None = None, **settings):
        text = "transport: local\n" + "".join(f"{k}: {v}\n" for k, v in settings.items())
        text += "nodes:\n" + "".join(f"  - {{host: h{i}, gpus: {gpus}}}\n" for i in range(n))
        self.plan = make_plan(parse_cluster(text), "train.py", [], "J1", "/tmp")
        if replan:  # plan fields no cluster file sets (a restart's vetted nodes, --allow-busy-gpus)
            self.plan = replace(self.plan, **replan)
        self.clock = Clock()
        self.queue = FakeQueue(self.clock)
        self.view = RecordingView()
        self.sweeper = FakeSweeper()
        self.inbox = SignalInbox()  # never installed: tests call its handler directly, as the kernel would
        self.nodes: list[FakeNode] = []

        def sessions(plan, post, clock):
            self.nodes = [FakeNode(i, post, self.clock, master=(i == 0), queue=self.queue) for i in range(n)]
            return self.nodes

        self.job = Job(self.plan, self.view, sessions=sessions, opener=lambda ss: [s.open() for s in ss],
                       sweeper=self.sweeper, events=self.queue, inbox=self.inbox, clock=self.clock,
                       wall=lambda: self.clock.now)

    def signal(self, signum: int = SIGINT) -> None:
        self.inbox._record(signum, None)

    def signal_at(self, when: float, signum: int = SIGINT) -> None:
        self.queue.at(when, lambda: self.signal(signum))

    def lines(self, node: int, *texts: str, rank: int | None = None, stream: str = "out") -> Lines:
        return Lines(node, [LogLine(stream, rank, t) for t in texts])

    def close_channel(self, node: int, *tail: str) -> Closed:
        return Closed(node, ChannelEnd(exit_status=255, stderr_tail=tail))

    def states(self) -> list[str]:
        return [s.state for s in self.job.status]
