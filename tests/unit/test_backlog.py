"""A detached job's journals: stamped with the node's clock, merged in time order by ddp-logs and
ddp-attach, and its ranks' bars now kept beside the journal for a live attach."""

from __future__ import annotations

import os

from orchestrator.job.backlog import BacklogOrder
from orchestrator.job.events import Closed, Lines, LogLine, Message
from orchestrator.remote.channel import ChannelEnd
from orchestrator.node.supervise import replay
from orchestrator.node.local import state
from orchestrator.node.protocol import wire
from tests.unit.fakejob import Harness


def said(node: int, frame: wire.Frame) -> Message:
    return Message(node, frame)


def text(node: int, line: str) -> Lines:
    return Lines(node, [LogLine("out", node, line)])


def texts(events: list) -> list[str]:
    return [line.text for e in events if isinstance(e, Lines) for line in e.lines]


def test_two_nodes_backlogs_come_out_in_time_order_each_nodes_own_in_its_order():
    order, out = BacklogOrder(2), []
    arrivals = [said(0, wire.Stamp(at=1.0)), text(0, "a1"), text(0, "a1b"), said(0, wire.Stamp(at=3.0)), text(0, "a3"),
                said(0, wire.JournalEnd(running=False)),
                said(1, wire.Stamp(at=2.0)), text(1, "b2"), said(1, wire.Stamp(at=4.0)), text(1, "b4"),
                said(1, wire.Replayed())]
    for event in arrivals:
        out += order.take(event)
    assert texts(out) == ["a1", "a1b", "b2", "a3", "b4"]
    assert order.live and order.take(text(1, "live")) == [text(1, "live")]  # then straight through
    assert order.take(said(1, wire.Stamp(at=5.0))) == []  # stamps in the live part are the order's too


def test_nothing_is_held_past_what_a_replaying_node_could_still_send_before():
    order = BacklogOrder(2)
    assert order.take(said(0, wire.Stamp(at=5.0))) == [] and order.take(text(0, "a5")) == []  # node 1 may have older
    assert texts(order.take(said(1, wire.Stamp(at=6.0)))) == ["a5"]  # it has not: a5 goes
    assert order.take(text(1, "b6")) == []  # node 0 may still send lines of 5.x
    assert texts(order.take(Closed(0, ChannelEnd(exit_status=255, stderr_tail=())))) == ["b6"]


def test_a_node_never_reached_holds_the_others_back_only_until_the_attach_lets_it_go():
    """A node cut off as an attach begins sends nothing: the others' journals, their ends among
    them, wait for it until the attach gives up on it, and their ends count meanwhile (a node whose
    journal has ended is not silent, it is done)."""
    order = BacklogOrder(3)
    held = [said(0, wire.Stamp(at=1.0)), text(0, "a1"), said(0, wire.JournalEnd(running=False)),
            said(1, wire.Stamp(at=2.0)), text(1, "b2"), Closed(1, ChannelEnd(exit_status=0, stderr_tail=()))]
    assert [e for event in held for e in order.take(event)] == []  # node 2 may have older lines
    assert order.ended == {0, 1}
    out = [e for _, e in order.let_go(2)]
    assert texts(out) == ["a1", "b2"] and isinstance(out[-1], Closed)
    assert order.let_go(2) == [] and order.let_go(9) == []


def test_a_journal_without_stamps_keeps_the_node_by_node_order():
    order, out = BacklogOrder(2), []
    for event in [text(0, "a"), text(1, "b"), text(0, "c")]:
        out += order.take(event)
    assert texts(out) == ["a", "b", "c"]


def test_a_live_nodes_lines_wait_for_the_others_backlog():
    order = BacklogOrder(2)
    assert order.take(said(0, wire.Replayed())) == []  # the order's own word: nothing to handle
    assert order.take(text(0, "live")) == []
    out = order.take(said(1, wire.Stamp(at=9.0))) + order.take(text(1, "old")) + order.take(said(1, wire.Replayed()))
    assert texts(out) == ["old", "live"]


def test_a_bad_stamp_or_an_unknown_node_is_passed_on_not_raised():
    order = BacklogOrder(1)
    assert order.take(said(0, wire.Stamp(at="soon"))) == [] and order.take(text(0, "x")) != []
    assert order.take(text(7, "y")) == [text(7, "y")]


def test_ddp_logs_of_two_nodes_shows_their_lines_in_time_order():
    h = Harness(2)

    def replay_(node, *frames):
        def open_() -> None:
            node.started = True
            for frame in frames:
                node.post(frame) if isinstance(frame, Lines) else node.say(frame)
        node.open = open_

    ended = wire.Exited(code=0, signal=None, stopped=False, reason=None)
    replay_(h.nodes[0], wire.Stamp(at=10.0), wire.Started(), h.lines(0, "n0 first", rank=0), wire.Stamp(at=12.0),
            h.lines(0, "n0 third", rank=0), ended, wire.JournalEnd(running=False))
    replay_(h.nodes[1], wire.Stamp(at=11.0), wire.Started(), h.lines(1, "n1 second", rank=1), wire.Stamp(at=13.0),
            h.lines(1, "n1 fourth", rank=1), ended, wire.JournalEnd(running=False))
    result = h.job.follow()
    assert result.exit_code == 0
    assert [line.text for line in h.view.lines_seen] == ["n0 first", "n1 second", "n0 third", "n1 fourth"]


def test_the_journal_is_stamped_every_so_often_and_never_back(tmp_path, monkeypatch):
    now = [100.0]
    monkeypatch.setattr(state.time, "time", lambda: now[0])
    journal = state.Journal(str(tmp_path / "journal"), str(tmp_path / "bars"))
    frame = wire.Output("out", 0, b"x\n").encode()
    for t in (100.0, 100.1, 100.3, 99.0):  # the clock stepped back last
        now[0] = t
        journal.append(frame)
    journal.close()
    frames = wire.Decoder(wire.TO_CONTROLLER).feed((tmp_path / "journal").read_bytes())
    assert [f.at for f in frames if isinstance(f, wire.Stamp)] == [100.0, 100.3]
    assert sum(isinstance(f, wire.Output) for f in frames) == 4


def test_the_bars_file_holds_the_bars_now_and_a_reader_skips_one_older_than_the_journal(tmp_path):
    path = str(tmp_path / "bars")
    journal = state.Journal(str(tmp_path / "journal"), path)
    journal.keep_bars([["err", 0, ["50%|#####     | 5/10"]], ["err", 1, ["10%|#         | 1/10"]]])
    assert state.read_bars(path, 0) == wire.Bars(bars=[["err", 0, ["50%|#####     | 5/10"]],
                                                        ["err", 1, ["10%|#         | 1/10"]]])
    journal.keep_bars([["err", 1, []]])  # rank 1's bar cleared: written at once, though 1 s has not passed
    assert state.read_bars(path, 0) == wire.Bars(bars=[["err", 0, ["50%|#####     | 5/10"]]])
    assert state.read_bars(path, 1) is None  # the reader saw a later journaled Bars than the file's
    os.unlink(path)
    os.mkfifo(path)  # planted: never opened for reading, never waited on
    assert state.read_bars(path, 0) is None
    journal.close()


def test_a_live_follower_sends_the_bars_file_each_time_it_changes(tmp_path):
    path = str(tmp_path / "bars")
    journal = state.Journal(str(tmp_path / "journal"), path)
    sent = []
    writer = type("W", (), {"send": lambda self, f, block=True: sent.append(f)})()
    live = replay.LiveBars(path)
    live.send_new(writer)  # no file yet: nothing
    journal.keep_bars([["err", 0, ["1/10"]]])
    live.send_new(writer)
    live.send_new(writer)  # unchanged: not again
    assert sent == [wire.Bars(bars=[["err", 0, ["1/10"]]])]
    journal.close()


def test_each_event_comes_out_with_the_time_its_node_recorded_it():
    order, out = BacklogOrder(2), []
    for event in [text(0, "before any stamp"), said(0, wire.Stamp(at=1.0)), text(0, "a1"),
                  said(0, wire.JournalEnd(running=False)), said(1, wire.Stamp(at=2.0)), text(1, "b2"),
                  said(1, wire.Replayed(started=0.5, master="h:1"))]:
        out += order.take_timed(event)
    assert [(at, e.lines[0].text) for at, e in out if hasattr(e, "lines")] == [(None, "before any stamp"), (1.0, "a1"),
                                                                                (2.0, "b2")]
    assert order.take_timed(text(1, "live")) == [(None, text(1, "live"))]  # live: the view's own clock
