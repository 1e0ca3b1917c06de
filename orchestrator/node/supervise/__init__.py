"""A detached job, on its own: its run and restarts (detached), the supervisor on the master's
node (supervisor: what it hears, hearing; its watch, watching; what it wrote, ledger) and every
other node's link to it (peerlink; where they meet: door), their decisions as
pure functions (decide; an elastic job's nodes: members), the notices sent away from the screen
(notify), and its journal replayed (replay).

May import: every room before it (userpython to attempt).
"""
