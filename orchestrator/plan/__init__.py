"""Stage 2, the plan: config + script + arguments -> one launch spec per node. Pure: no I/O.

launch makes the plan (ranks, master, the launcher's line, the RunSpec each agent gets); sbatch
writes the batch script that runs ddp-up inside a Slurm allocation.

May import: config, node, and the leaf modules.
"""
