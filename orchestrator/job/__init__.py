"""Stage 5, one attempt of a job: the job loop and what it consumes.

loop owns the job's state and every change to it; session turns one node's agent into events
(events: the loop's one vocabulary); phases are the steps it takes in order, reports and pace
turn the nodes' frames into what the loop applies, hang and stoppath decide and carry out a stop,
nodetable keeps every node's status, backlog puts a detached job's journals back in time order.

May import: diagnose, remote, plan, config, node, and the leaf modules.
"""
