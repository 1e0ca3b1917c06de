"""The node's first room: what both ends agree on. The frames of every mode, both directions
(wire); the decisions the controller and a detached job's supervisor both make (policy:
restarts, hang, root cause; stragglers: who arrives late); the agent's own events (events).

Imports nothing of the node's: every other room imports it, and so does the controller.
"""
