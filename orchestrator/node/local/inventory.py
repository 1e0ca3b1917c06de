"""The state root taken as a whole: every detached job recorded on this node (list mode, ddp-ls),
and what of it is stale (the sweeps of ddp-kill and of every start). Never through a link: only
private directories named as ddp-up names them are entered (state.py keeps the layout).
"""

import json
import os
import shutil
import time

from .procs import TAG_CLUSTER, TAG_JOB, find_tagged
from .state import (JOB_ID, OUTCOME, RECORD, RETENTION, checked_record, cluster_of, live_record, live_state,
                    parse_node_dir, private_dir, read_record, state_root)


LISTING_MOST = 32 << 20  # bytes of records one listing carries (a frame's header holds them all)


def recorded_jobs():
    """([(node directory, record)] of every detached job here, with the master's outcome added;
    [what was skipped, with why]): a damaged or planted record is named, never read whole, and
    hides no other job."""
    root = state_root()
    if private_dir(root, create=False):
        return [], []
    found, skipped, size = [], [], 0
    for job in sorted(os.listdir(root)):
        job_dir = os.path.join(root, job)
        if not JOB_ID.fullmatch(job) or private_dir(job_dir, create=False):
            continue
        for _, path, _ in node_dirs(job_dir):
            record, why = checked_record(path)
            if record is None and why != "missing":
                skipped.append("%s: %s" % (os.path.join(path, RECORD), why))
                continue
            size += len(json.dumps(record)) if record is not None else 0
            if record is not None and size > LISTING_MOST:
                skipped.append("%s: not listed, the listing is full" % os.path.join(path, RECORD))
            elif record is not None:
                record = live_record(record, path)
                record["outcome"] = read_record(path, OUTCOME)
                found.append((path, record))
    return found, skipped


def node_dirs(job_dir):
    """(entry, path, tags) of each node directory of a job here: named as ddp-up names them, and
    a private directory of this user's (an entry that is a link is passed over, never followed)."""
    for entry in sorted(names_in(job_dir)):
        tags = parse_node_dir(entry)
        path = os.path.join(job_dir, entry)
        if tags is not None and not private_dir(path, create=False):
            yield entry, path, tags


def names_in(job_dir):
    """A job directory's entries, or none: it goes with the job's last node agent here, which may
    end while a ddp-kill or ddp-ls reads it (ddp-kill's own stop ends it)."""
    try:
        return os.listdir(job_dir)
    except FileNotFoundError:
        return []


def expired(record, now):
    """A finished job's record past its retention (the job's own, set when it started)."""
    retention = record.get("retention", RETENTION)
    if not isinstance(retention, (int, float)):
        retention = RETENTION
    return live_state(record) != "running" and now - (record.get("ended") or record.get("started") or 0) > retention


def remove_stale_state(match, purge=False, records_only=False, dry_run=False):
    """Remove the node directories (hooks, and any torchrun log copy kept for a vanished
    controller) of jobs that no longer have processes here; only in a private state root, only
    directories named as ddp-up names them, never through a link. A detached job's record and
    journal stay for its retention after its end, unless ``purge``; ``records_only``: only
    those (a launch's leftovers are a sweep's business). What it removed, ["JOB nodeN", ...];
    ``dry_run``: what it would remove once the sweep has stopped the processes it found."""
    root = state_root()
    removed = []
    if private_dir(root, create=False):
        return removed
    job = match.get(TAG_JOB)
    jobs = [job] if job else os.listdir(root)
    for name in jobs:
        job_dir = os.path.join(root, name)
        if not JOB_ID.fullmatch(name) or private_dir(job_dir, create=False):
            continue
        for entry, path, tags in node_dirs(job_dir):
            if TAG_CLUSTER in match and cluster_of(path) != match[TAG_CLUSTER]:
                continue  # another cluster file's job (a shared /tmp, an NFS TMPDIR): not this sweep's
            record = read_record(path)  # first: a /proc scan is the costly part
            if record is None and not purge and os.path.lexists(os.path.join(path, RECORD)):
                continue  # a detached job's record, damaged: its journal stays (ddp-kill --purge removes it)
            if record is None and records_only:
                continue
            if record is not None and not (purge or expired(record, time.time())):
                continue  # a detached job's, kept for its retention
            if dry_run or not find_tagged({TAG_JOB: name, **tags}):
                removed.append("%s %s" % (name, entry))
                if not dry_run:
                    shutil.rmtree(path, ignore_errors=True)  # does not follow links
        try:
            if not dry_run:
                os.rmdir(job_dir)  # only if empty
        except OSError:
            pass
    return removed
