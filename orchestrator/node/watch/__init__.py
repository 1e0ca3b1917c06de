"""Watching an attempt's processes: their streams relayed whole and as a terminal shows them
(relay, screen); their stacks and collectives on request (stacks, flight); how each rank ended
(teardown, failures, report) and what a function's launch returned (results).

May import: userpython, protocol, local, probes.
"""
