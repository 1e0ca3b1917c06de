"""Several views behind one: the job talks to one view; the console and the log files both listen."""

from __future__ import annotations


class Fanout:
    def __init__(self, *views):
        self.views = views

    def __getattr__(self, name: str):
        def call(*args, **kwargs):
            for view in self.views:
                method = getattr(view, name, None)
                if method is not None:
                    method(*args, **kwargs)
        return call
