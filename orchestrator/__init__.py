"""ddp-up: launch multi-node torchrun jobs over SSH and clean up exactly what was started.

The package is laid out as the pipeline it implements:
config (YAML -> frozen dataclasses) -> plan (pure launch specs) -> transport (SSH or local)
-> session (one node agent each) -> job (events, fail-fast, cleanup) -> views (terminal).

From Python: ``from orchestrator import launch, JobFailed`` (api.py).
"""

from .version import __version__
__all__ = ["launch", "fetch", "Run", "JobFailed", "LaunchRefused", "Detached"]


def __getattr__(name):
    """The Python API, imported on first use (the commands' start does not pay for it)."""
    if name == "fetch":
        from .fetch import fetch_all

        return fetch_all
    if name in __all__:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'orchestrator' has no attribute {name!r}")
