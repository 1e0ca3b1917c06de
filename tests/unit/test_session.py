"""A node session against a real agent on this machine (the local transport)."""

import queue

from orchestrator.node.protocol import wire
from orchestrator.config.clusterfile import parse_cluster
from orchestrator.job.events import Closed, Message, SetupFailed
from orchestrator.plan.launch import make_plan
from orchestrator.job.session import NodeSession
from orchestrator.remote.transports import transport_for


def test_hello_reaches_the_agent_first_even_after_early_heartbeats(tmp_path):
    """The agent reads exactly its source's length; a heartbeat queued before the hello (the job
    loop sends them as soon as a session has a process) once shifted the source and broke it."""
    (tmp_path / "train.py").write_text("")
    plan = make_plan(parse_cluster("transport: local\nnodes: [{host: a, gpus: 1}]\n"), "train.py", [], "J",
                     str(tmp_path))
    events: queue.SimpleQueue = queue.SimpleQueue()
    session = NodeSession(plan, plan.nodes[0], transport_for(plan.nodes[0].config), events.put)
    for _ in range(3):
        session.send(wire.Heartbeat())
    session.open()
    try:
        event = events.get(timeout=30)
        while not isinstance(event, (Message, SetupFailed, Closed)):
            event = events.get(timeout=30)
        assert isinstance(event, Message) and isinstance(event.frame, wire.Ready), event
    finally:
        session.disconnect()


def pipe_holds(fd: int) -> int:
    import array
    import fcntl
    import termios

    count = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, count)
    return count[0]


def test_closing_a_channel_whose_peer_reads_no_more_is_bounded():
    """A writer blocked on a peer that reads nothing (an ssh client whose link went down) holds the
    stream's lock: the close that the job loop makes of a lost node once waited on it for good.
    It now ends the process past CLOSE_WAIT, and the blocked write fails."""
    import subprocess
    import threading
    import time

    from orchestrator.remote.transport import CLOSE_WAIT, LocalProcess

    proc = LocalProcess(subprocess.Popen(["sleep", "60"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, start_new_session=True))
    failed = threading.Event()

    def write() -> None:
        try:
            proc.write(b"x" * (4 << 20))  # far past what a pipe holds: blocks
        except OSError:
            failed.set()
    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    deadline = time.monotonic() + 10  # the pipe full: the writer is blocked in its write, holding the lock
    while pipe_holds(proc.proc.stdin.fileno()) < 65536 and time.monotonic() < deadline:
        time.sleep(0.01)
    started = time.monotonic()
    proc.close()
    took = time.monotonic() - started
    try:
        assert took < CLOSE_WAIT + 5, took
        assert failed.wait(10) and proc.exit_status(10) is not None
    finally:
        proc.terminate()
        proc.proc.wait(10)
