"""Follow and list modes: a detached job's journal replayed (and followed while it grows), and
the detached jobs recorded on this node.
"""

import os
import time

from ..local.inventory import recorded_jobs, remove_stale_state
from ..local.state import (ATTEMPTS, BARS, JOURNAL, LIVE, OUTCOME, job_node_dir, live_record, live_state, open_regular,
                           per_attempt, read_bars, read_record, read_regular)
from ..protocol import wire


def follow(spec, writer):
    """Follow mode: the journal of one attempt of the job on this node, frame by frame, from its
    start; a later attempt's, once it has begun (a follower waits while the job waits to restart)."""
    where = job_node_dir(spec.job, spec.node)
    path = os.path.join(where or "", per_attempt(JOURNAL, spec.attempt))
    if spec.attempt and spec.follow and where:
        while not (os.path.exists(path) or writer.broken) and waiting_to_restart(read_record(where), spec.attempt):
            writer.send(wire.Heartbeat(), block=False)
            time.sleep(0.2)
    fd = open_regular(path) if where else None
    if fd is None:
        return no_journal(spec, where, writer)
    decoder = wire.Decoder(wire.TO_CONTROLLER)
    beat, record, bars = time.monotonic(), {}, LiveBars(os.path.join(where or "", per_attempt(BARS, spec.attempt)))
    with os.fdopen(fd, "rb", buffering=0) as f:
        skip = backlog_to_skip(f, spec.tail) if spec.tail is not None else {}
        while not writer.broken:
            record = live_record(read_record(where) or {}, where)
            state, current = record["state"], record.get("attempt", 0)
            running = attempt_live(state, current, spec.attempt)
            data = f.read(1 << 20)
            if data:
                frames, damage = decoded(decoder, data)
                for frame in frames:
                    bars.journaled += type(frame) is wire.Bars
                    frame = skip_lines(frame, skip) if skip else frame
                    if frame is not None:
                        writer.send(frame)
                if damage is None:
                    continue
                writer.send(wire.Output("err", None, ("ddp-up: this node's journal is damaged (%s); what it held "
                                                      "before is shown, nothing after\n" % damage).encode()))
                running = False
                break
            if not bars.replayed:
                bars.replayed = True
                writer.send(wire.Replayed(started=record.get("started"), master=record.get("master")))
            if not (spec.follow and running):
                break
            bars.send_new(writer)
            if time.monotonic() - beat > spec.heartbeat:
                writer.send(wire.Heartbeat(), block=False)
                beat = time.monotonic()
            time.sleep(0.1)
    later = current > spec.attempt or (spec.follow and state in ("restarting", "away") and current == spec.attempt)
    return journal_end(writer, running, later, record, awaited(where, spec.attempt, writer) if later else
                       decided(where, spec.attempt))


DECISION_WAIT = 120.0  # seconds a follower of the master node's journal waits for its supervisor's decision


def awaited(where, attempt, writer):
    """decided's, where this node is the master (it keeps the attempts file) and a later attempt
    may follow: waited for (bounded) while its supervisor waits for every node to end the attempt."""
    deadline = time.monotonic() + DECISION_WAIT
    after = decided(where, attempt)
    while not after and read_record(where or "", ATTEMPTS) is not None and time.monotonic() < deadline \
            and not writer.broken:
        writer.send(wire.Heartbeat(), block=False)
        time.sleep(0.2)
        after = decided(where, attempt)
    return after


def decided(where, attempt):
    """What the supervisor decided after ``attempt``, where this node is the master and it is
    written (in the outcome once the job is over, before that in the attempts file it keeps at each
    restart), as JournalEnd's fields: its words ("restart 1 of 3", "no restarts left"); in an elastic
    job, the next attempt's nodes (indices), the node it found lost, whether it stopped the attempt
    to take nodes back; whether the job ended with it. {} elsewhere."""
    for name in (OUTCOME, ATTEMPTS):
        entries = (read_record(where or "", name) or {}).get("attempts") or ()
        for entry in entries:
            if isinstance(entry, dict) and entry.get("attempt") == attempt and isinstance(entry.get("next"), str):
                nodes, root = entry.get("next_nodes"), entry.get("root_cause") or {}
                lost = root.get("node") if isinstance(root, dict) and root.get("state") == "lost" else None
                why = root.get("reason") if lost is not None else None
                return {"next": entry["next"], "nodes": nodes if is_ints(nodes) else None,
                        "lost": lost if is_ints([lost]) else None, "lost_why": why[:500] if isinstance(why, str) else None,
                        "reshaped": entry.get("reshaped") if entry.get("reshaped") in ("grow", "aside") else None,
                        "over": name == OUTCOME and entry is entries[-1]}
    return {}


def is_ints(value):
    return isinstance(value, list) and all(type(n) is int for n in value)


def no_journal(spec, where, writer):
    """The attempt's journal is not here: the job ended before it restarted, or is not here at all."""
    if spec.attempt and read_record(where or "") is not None:
        writer.send(wire.JournalEnd(running=False, absent=True))
    elif where and read_record(where) is not None:
        writer.send(wire.Failed("job %s's journal on this node cannot be read (%s)" % (
            spec.job, read_regular(os.path.join(where, per_attempt(JOURNAL, spec.attempt)))[1]),
            "its record stays; ddp-kill CLUSTER.yaml --job %s --purge removes both" % spec.job))
    else:
        writer.send(wire.Failed("no detached job %s on this node" % spec.job,
                                "ddp-ls CLUSTER.yaml lists the jobs on the cluster's nodes"))
    writer.drain(5)
    return 3 if not spec.attempt else 0


class LiveBars:
    """A live follower's bars: the journal keeps them every 10 s; the bars file beside it (the
    ranks' bars now) is sent each time it changes, unless the journal has a later Bars."""

    def __init__(self, path):
        self.path, self.journaled, self.replayed, self.seen = path, 0, False, None

    def send_new(self, writer):
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except OSError:
            return
        if (st.st_mtime_ns, st.st_size, st.st_ino) == self.seen:
            return
        self.seen = (st.st_mtime_ns, st.st_size, st.st_ino)
        frame = read_bars(self.path, self.journaled)
        if frame is not None:
            writer.send(frame)


def journal_end(writer, running, later, record, after=None):
    """The journal was sent to its end: say so, with what the record says of the job here (and,
    on the master node, what its supervisor decided after the attempt: decided's)."""
    writer.send(wire.JournalEnd(running=running, later=later, started=record.get("started"), ended=record.get("ended"),
                                master=record.get("master"), **(after or {})))
    writer.drain(30)
    return 0


def decoded(decoder, data):
    """(the frames in ``data``, None), or, where the journal is damaged, (the frames before the
    damage, what is wrong): its undamaged part is still shown."""
    try:
        return decoder.feed(data), None
    except wire.ProtocolError as e:
        return getattr(e, "frames", []), str(e)


def attempt_live(state, current, attempt):
    """Whether ``attempt``'s journal may still grow, from the record: the job runs it, or is just
    starting it (an agent creates an attempt's journal, then records that it runs it)."""
    return state in LIVE and (current < attempt or (current == attempt and state == "running"))


def waiting_to_restart(record, attempt):
    """Whether the job may still begin ``attempt`` here (it waits to restart, or runs the one before)."""
    record = record or {}
    return live_state(record) in LIVE and record.get("attempt", 0) < attempt


def backlog_to_skip(f, tail):
    """{(stream, rank): lines} to leave out so that ``tail`` lines of each remain of what the
    journal holds now (read from ``f``, which is then rewound)."""
    counts = {}
    decoder = wire.Decoder(wire.TO_CONTROLLER)
    while True:
        data = f.read(1 << 20)
        if not data:
            break
        for frame in decoder.feed(data):
            if type(frame) is wire.Output:
                key = (frame.stream, frame.rank)
                counts[key] = counts.get(key, 0) + frame.data.count(b"\n")
    f.seek(0)
    return {key: count - tail for key, count in counts.items() if count > tail}


def skip_lines(frame, skip):
    """``frame`` without the lines still to be skipped of its stream (None if nothing is left)."""
    if type(frame) is not wire.Output:
        return frame
    key = (frame.stream, frame.rank)
    left = skip.get(key, 0)
    if not left:
        return frame
    data, at = frame.data, 0
    while left and at < len(data):
        end = data.find(b"\n", at)
        if end < 0:
            at = len(data)  # the start of a line that ends in a later frame: skipped with it
            break
        at, left = end + 1, left - 1
    if left:
        skip[key] = left
    else:
        del skip[key]
    rest = data[at:]
    return wire.Output(frame.stream, frame.rank, rest) if rest else None


def list_jobs(spec, writer):
    remove_stale_state({}, records_only=True)  # what is past its retention is not listed, and goes
    found, skipped = recorded_jobs()
    writer.send(wire.Jobs(jobs=[record for _, record in found], skipped=skipped or None))
    writer.drain(5)
    return 0
