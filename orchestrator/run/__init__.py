"""Stage 7, a run: attempts one after another, and what outlives them.

runloop runs attempt after attempt (attempts decides who runs and whether another comes, by
node/policy's one restart rule); follow replays a detached job as a live run; record writes
`runs/<job-id>/` (run.json, summary.json); notifier sends the job's events to `notify:` targets.

May import: views, job, diagnose, remote, plan, config, node, and the leaf modules.
"""
