"""The job's events sent to the cluster file's ``notify:`` targets.

A Notifier is one of the job's views: the events the job loop calls ``event`` with, and the job's
end (``finished``). Apprise sends the URLs; the webhook and the command are node/supervise/notify.py's. Every
payload is masked, so no message ever shows a secret.
"""

from __future__ import annotations

from typing import Callable

from ..config.masking import mask_secrets, mask_values
from ..config.notify import Target, load_apprise
from ..errors import EXIT_INTERNAL
from ..node.supervise import notify as sender
from ..node.supervise.notify import Deliveries, event

_TYPE = {"ended": "success", "restart": "warning", "hang": "failure", "straggler": "warning", "signal": "warning",
         "lost": "failure"}


def send_url(url: str, payload: dict) -> None:
    """Through Apprise: the event's text, titled; a failure raises with Apprise's own words."""
    apprise = load_apprise()
    notifier = apprise.Apprise()
    notifier.add(url)
    said: list[str] = []
    ok = notifier.notify(body=payload["text"], title=f"ddp-up {payload['job_id']}: {payload['event']}",
                         notify_type=_TYPE[payload["event"]] if payload.get("ok") is not False else "failure",
                         timeout=sender.TIMEOUT, log_callback=lambda entry, _: said.append(entry.message))
    if not ok:
        raise OSError(said[-1] if said else "Apprise could not send it")


SENDERS = {"url": send_url, **sender.SENDERS}


class Notifier:
    """A view that sends the job's events (``event``) and its end (``finished``) to every target."""

    def __init__(self, targets: tuple[Target, ...], job_id: str, secrets: frozenset[str],
                 warn: Callable[[str], None], senders: dict | None = None):
        self.job_id, self.secrets, self.warn = job_id, secrets, warn
        self.deliveries = Deliveries([t.wire() for t in targets], self._failed, senders or SENDERS)

    def event(self, kind: str, text: str, **fields) -> None:
        payload = event(kind, self.job_id, text, **fields)
        self.deliveries.send(mask_values(payload, self.secrets))

    def finished(self, result, attempts=()) -> None:
        """The job's end: ok, or failed with its root cause; or stopped by a signal."""
        root = result.root_cause
        text = result.ending(attempts)
        if root is not None:
            text += f"; root cause: {root.render()}"
        self.event("ended", text, ok=result.exit_code == 0, exit_code=result.exit_code,
                   root_cause=None if root is None else root.render(), attempts=len(attempts) or 1)

    def unstarted(self, error: Exception) -> None:
        """The run ended before a job's end could be told: a node not ready (exit 3), a signal
        before the start, an internal error (70). Still an ``ended`` event, then the sends' end."""
        code = getattr(error, "exit_code", None) or (128 + error.signum if hasattr(error, "signum") else EXIT_INTERNAL)
        why = error.render() if hasattr(error, "render") else f"internal error in ddp-up ({type(error).__name__})"
        self.event("ended", f"job {self.job_id} did not run (exit status {code}): {why}", ok=False, exit_code=code,
                   root_cause=None, attempts=0)
        self.close()

    def close(self) -> None:
        """Wait for the sends under way (each bounded by node/notify.TIMEOUT)."""
        self.deliveries.wait()

    def _failed(self, index: int, kind: str, why: str) -> None:
        self.warn(f"notify[{index}] ({kind}) failed: {mask_secrets(why, self.secrets)}; the job is not affected (told once)")
