"""Secrets masked in everything ddp-up shows or keeps: a screen line, a log file, a record, a message.

The secrets are the values the cluster file names as such (``secrets:``, the env's tokens, a
notify target's URL parts); the plan collects them, and every writer masks with these two.
"""

from __future__ import annotations


def mask_secrets(text: str, values) -> str:
    """Every secret value in ``text`` as ``***``, longest first: a secret that begins with another
    must not be half-replaced by the shorter one."""
    for value in sorted(values, key=len, reverse=True):
        if value in text:
            text = text.replace(value, "***")
    return text


def mask_values(value, secrets):
    """``value`` (JSON-like: strings, lists, dicts) with every secret in every string masked."""
    if not secrets:
        return value
    if isinstance(value, str):
        return mask_secrets(value, secrets)
    if isinstance(value, list):
        return [mask_values(v, secrets) for v in value]
    if isinstance(value, dict):
        return {k: mask_values(v, secrets) for k, v in value.items()}
    return value
