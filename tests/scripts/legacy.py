"""A script written for `python -m torch.distributed.launch`: it parses --local_rank (underscore)."""

import argparse
import os

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int)
parser.add_argument("--tag")
args = parser.parse_args()
print(f"LEGACY rank={os.environ['RANK']} local_rank_arg={args.local_rank} local_rank_env={os.environ['LOCAL_RANK']} "
      f"tag={args.tag}", flush=True)
