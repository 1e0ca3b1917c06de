"""Holds 2 GiB on GPU 0 until killed: the busy-GPU check's other user (capture.sh)."""
import sys
import time

import torch

held = torch.empty(2 << 30, dtype=torch.uint8, device="cuda:0")
open(sys.argv[1], "w").write("held\n")
time.sleep(600)
