"""Code that runs in the user's Python, not the agent's: stdlib only (Python 3.8+), and nothing
of ddp-up's but this room is importable there.

Imports nothing of the node's.
"""
