"""Stage 4, the diagnosis: what the nodes' words and records say, as values. Pure where it can be.

outcome holds what a job is and was (node statuses, the result); logparse reads torchrun's and the
workers' words; rankfailures names the rank that failed first, with its exception; flight reads
the Flight Recorder records of a hang; progress reads the progress bars; preflight compares the
nodes before the start; collective is ddp-check's all_reduce measurement (collective_probe runs
on the nodes).

May import: remote, plan, config, node, and the leaf modules.
"""
