"""``notify:`` in the cluster file: who hears of a job's events away from the screen (the targets).

    notify:
      - ntfy://ntfy.sh/my-runs                  # any Apprise URL: Slack, Discord, email, ntfy, Telegram...
      - webhook: http://127.0.0.1:8080/ddp      # POST the event's JSON (node/supervise/notify.py)
      - command: ./on-event.sh                  # the event's JSON on stdin
        on: [ended, hang]                       # only these events (default: all)

Apprise (a well-kept library of 100+ services) sends the URLs; the webhook and the command are
node/supervise/notify.py's, which a detached job's supervisor uses too (Apprise URLs are not sent from
there: it is stdlib only). The sending is the run's (run/notifier.py). Every target's URL is one of
the plan's secrets (a token is often in it), so no message ever shows one.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import parse_qsl, unquote, urlsplit

from ..node.supervise.notify import EVENTS

KINDS = ("url", "webhook", "command")


@dataclass(frozen=True)
class Target:
    kind: str  # "url" (Apprise), "webhook", "command"
    value: str
    events: tuple[str, ...] | None = None  # None: every event

    def wire(self) -> list:
        """As node/supervise/notify.py takes it (and RunSpec.notify carries it)."""
        return [self.kind, self.value, None if self.events is None else list(self.events)]

    def secrets(self) -> set[str]:
        """The parts of the target that are secrets, masked wherever ddp-up prints (not the whole
        target: `command: true` would mask every "true" in every log). A URL's password, query
        values and path segments, and for an Apprise URL its host part too (tgram://BOT_TOKEN/...);
        in a command, the words that look like tokens."""
        if self.kind == "command":
            words = re.split(r"[\s='\":]+", self.value)
            return {w for w in words if len(w) >= 12 and re.search(r"\d", w) and re.search(r"[A-Za-z]", w)}
        parts = urlsplit(self.value)
        segments = {unquote(p) for p in parts.path.split("/")} | set(parts.path.split("/"))
        found = {parts.password or "", parts.fragment, *(v for _, v in parse_qsl(parts.query))}
        if parts.scheme in ("http", "https"):  # a webhook: its tokens are in its path, not its host
            found |= {p for p in segments if len(p) >= 20 or (len(p) >= 8 and re.search(r"\d", p))}
        else:  # Apprise's: tgram://BOT:TOKEN/CHAT, slack://A/B/C, ntfy://host/topic (not a domain's name)
            found |= segments | {p for p in re.split(r"[:@]", parts.netloc) if "." not in p}
        return {p for p in found if len(p) >= 6}


def targets(value: Any, error: Callable[[tuple, str], Exception]) -> tuple[Target, ...]:
    """`notify:`'s targets; ``error(at, why)`` makes the ConfigError for a key below `notify`."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise error((), "must be a list of targets: Apprise URLs, `webhook: URL` or `command: LINE`")
    return tuple(_target(item, (i,), error) for i, item in enumerate(value))


def _target(item: Any, at: tuple, error) -> Target:
    if isinstance(item, str):
        item = {"url": item}
    if isinstance(item, dict) and True in item and "on" not in item:  # YAML 1.1 reads an unquoted `on:` as true
        item = {"on" if key is True else key: value for key, value in item.items()}
    if not isinstance(item, dict) or len([k for k in KINDS if k in item]) != 1 or set(item) - {*KINDS, "on"}:
        raise error(at, "must be an Apprise URL, or one of `url:`, `webhook:`, `command:` (and `on:` a list of events)")
    kind = next(k for k in KINDS if k in item)
    value = item[kind]
    if not isinstance(value, str) or not value.strip():
        raise error(at + (kind,), "must be a non-empty string")
    if kind == "webhook" and not value.startswith(("http://", "https://")):
        raise error(at + (kind,), "must be an http:// or https:// URL")
    if kind == "url" and not apprise_knows(value):
        scheme = value.partition("://")[0][:20] if "://" in value else "none"  # never the rest: a token
        raise error(at + (kind,), f"Apprise does not know this URL (scheme {scheme!r}); see "
                                  "https://github.com/caronc/apprise/wiki for the services and their URLs")
    on = item.get("on")
    if on is not None and (not isinstance(on, list) or not on or any(e not in EVENTS for e in on)):
        raise error(at + ("on",), f"must be a list of events out of {', '.join(EVENTS)}")
    return Target(kind, value, None if on is None else tuple(on))


def load_apprise():
    import apprise  # only where a URL is set: its import is a tenth of ddp-up's start

    quiet = logging.getLogger("apprise")  # its failures are told here, masked, once; never on stderr
    if not quiet.handlers:
        quiet.addHandler(logging.NullHandler())
        quiet.propagate = False
    return apprise


def apprise_knows(url: str) -> bool:
    return bool(load_apprise().Apprise().add(url))
