"""Starting an attempt's processes: ddp-up's own launcher (workers, `launcher: none`), the warm
interpreter that forks the ranks (warm), the job in a container image (container) and a warm
container kept from one launch to the next (keptbox); and the first processes that run in the
image (boxwarm, boxkeep).

May import: userpython, protocol, local, probes, watch.
"""
