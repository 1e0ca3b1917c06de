"""The names the agent and its code in the user's Python share, written once: how ddp-up's
processes there show in ps (local/procs.py finds them by these) and this room's own name in the user's
Python. (The rank hook's own names are its own: as a sitecustomize, it stands alone.)

The warm interpreter's command line starts with WARM_MARK (its children are the ranks, as a
launcher's are); a stand-in's with STUB_MARK (torchrun's worker under warm start).
"""

PACKAGE = "ddp_up_userpython"  # this room's name in the user's Python, as the agent writes it there (local/ourcode.py)
WARM_MARK = "'ddp_up_warm';"
STUB_MARK = "'ddp_up_warm_rank';"
TORCHRUN = "torch.distributed.run"  # torchrun's module: the plan's launcher line runs `python -u -m TORCHRUN`

