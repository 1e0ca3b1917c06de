"""What the node is: its network (interfaces, routes) and its GPUs as nvidia-smi tells them
(facts, each question to nvidia-smi asked by smi), and their health (gpuhealth). Each probe is bounded: a hung tool is named, never waited on.

May import: protocol, local.
"""
