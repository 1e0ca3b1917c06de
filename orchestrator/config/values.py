"""Values as a cluster file writes them, read once: durations, environment values, .env files."""

from __future__ import annotations

import datetime
import math
import re
from typing import Any

from ..errors import ConfigError

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # always with fullmatch: `$` would accept "NAME\n"
NUL_VALUE = "holds a NUL character, which no process's environment can: remove it"


def read_dotenv(text: str, path: str) -> dict[str, str]:
    """NAME=value lines, `export ` allowed, # comments, quotes; a bad line is named, never echoed
    (it may hold a secret)."""
    found = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, eq, val = line.removeprefix("export ").partition("=")
        name, val = name.strip(), val.strip()
        if not eq or not ENV_NAME.fullmatch(name):
            raise ConfigError(path, number, "", "expected NAME=value (a letter or _ first, then letters, "
                                                "digits, _), an `export ` prefix, a # comment or nothing")
        if len(val) >= 2 and val[0] == val[-1] and val[0] in "'\"":
            val = val[1:-1]
        if "\0" in val:
            raise ConfigError(path, number, name, NUL_VALUE)
        found[name] = val
    return found


ENV_VALUE_TYPES = (str, int, float, datetime.date)  # bool is an int; a date is the text it was written as


def env_text(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
# A duration as text: the validator reads it with this, and the JSON Schema says the same pattern.
DURATION_PATTERN = r"^\s*[0-9]+(\.[0-9]+)?\s*[smhdSMHD]?\s*$"


def parse_duration(value: Any) -> float | None:
    """Seconds from a number or a string with a unit ("90", "90s", "5m", "1.5h", "7d"); None if
    it is neither, or not finite."""
    if isinstance(value, str):
        if not re.match(DURATION_PATTERN, value):
            return None
        text = value.strip()
        scale = DURATION_UNITS.get(text[-1:].lower(), 0)
        value = float(text[:-1] if scale else text) * (scale or 1)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def whole(value: Any) -> int | None:
    """An integer as JSON Schema's "integer" means it (2, or 2.0), else None (never a bool)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) else None
