"""ddp-up: launch multi-node torchrun jobs over SSH and clean up exactly what was started.

The package is laid out as the pipeline it implements:
config (YAML -> frozen dataclasses) -> plan (pure launch specs) -> transport (SSH or local)
-> session (one node agent each) -> job (events, fail-fast, cleanup) -> views (terminal).
"""

__version__ = "0.1.0"
