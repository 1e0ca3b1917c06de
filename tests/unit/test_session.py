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
