"""ddp-up: launch multi-node torchrun jobs over SSH and clean up exactly what was started.

The package is laid out as the pipeline it implements, one package a stage; a stage imports only
the stages before it (tests/unit/test_shape.py holds the order):

    node      the agent that runs on every node (stdlib only, shipped)
    config    the cluster file -> frozen, validated values
    plan      config + script -> one launch spec per node (pure)
    remote    the nodes reached: transports, the agent's channel, one-shot calls
    diagnose  what the nodes' words and records say: outcome, root cause, hangs, progress
    job       one attempt: the job loop, its events, phases, stop path
    views     the terminal, the dashboard, the log files
    run       attempts one after another, detached jobs followed, the run's record, notices
    commands  the command lines and their exit statuses

Leaf modules every stage may use: errors, ownfiles (files in shared folders), clean (a rank's text
made safe to show), version. From Python: ``from orchestrator import launch, JobFailed`` (api.py).
"""

from .version import __version__

__all__ = ["launch", "fetch", "release_warm", "Run", "JobFailed", "LaunchRefused", "FetchFailed", "Detached"]


def __getattr__(name):
    """The Python API, imported on first use (the commands' start does not pay for it)."""
    if name in __all__:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'orchestrator' has no attribute {name!r}")
