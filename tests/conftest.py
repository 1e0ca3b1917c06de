import os
import sys
from pathlib import Path

# The package is importable from a checkout without installing it (tests run it by source).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.pop("DDP_UP_JOB", None)
