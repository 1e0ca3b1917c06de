"""Files in and out of the node: the workdir copy before a launch (sync mode) and ddp-fetch's
files back (fetch mode).

May import: protocol, local.
"""
