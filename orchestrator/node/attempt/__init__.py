"""An attached run on this node: its preflight (checks), each attempt's processes from start to
end (launch), run mode's loop around them (run), and keep mode's interpreter kept for a Python
session's launches (keep).

May import: userpython, protocol, local, probes, files, watch, launchers.
"""
