"""Processes and private state on this node: the job's processes, found and signalled by their
tags (procs); the agent's private directories, records and journals, never through a link
(state); the state root taken whole: the jobs recorded here and what is stale (inventory).

May import: protocol.
"""
