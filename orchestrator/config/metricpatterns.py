"""`metrics:` in the cluster file, checked when it is read: the patterns that read more of what
ranks print as metrics (diagnose/metrics.py reads the lines with them), and the plain names kept.
"""

from __future__ import annotations

import re

NAME_MOST = 64  # characters of a metric's name


def plain_name(name: str) -> str:
    """A metric's name as kept: printable ASCII of the name characters, bounded; "" if none."""
    kept = "".join(c for c in name[:NAME_MOST] if c.isascii() and (c.isalnum() or c in "_.-/ "))
    return kept.strip()


# A pattern of `metrics:` runs on every line a rank prints, which is untrusted: one that could take
# more than linear time is refused when the cluster file is read. Python's engine backtracks, so
# the shapes that make it slow are refused by their structure: a backreference or a lookaround, a
# repeat inside a repeated group or a repeated alternative (exponential), and more than one
# unbounded repeat (polynomial); a bounded repeat may go up to BOUNDED_MOST.
BOUNDED_MOST = 1000
PATTERN_MOST = 500  # characters of one pattern


def pattern_problem(text: str) -> str | None:
    """Why ``text`` cannot be a `metrics:` pattern, or None."""
    try:
        from re import _parser as parser  # Python 3.11+
    except ImportError:  # pragma: no cover - Python 3.9, 3.10
        import sre_parse as parser
    if len(text) > PATTERN_MOST:
        return f"longer than {PATTERN_MOST} characters"
    try:
        regex = re.compile(text)
        tree = parser.parse(text)
    except (re.error, RecursionError, OverflowError) as e:
        return f"not a regular expression ({e})"
    if "value" not in regex.groupindex:
        return "has no (?P<value>...) group: the number it reads"
    unbounded = 0
    for op, body, repeated in walk(tree, parser, False):
        name = str(op).upper()
        if name in ("GROUPREF", "GROUPREF_EXISTS", "ASSERT", "ASSERT_NOT"):
            return "uses a backreference or a lookaround, which can take more than linear time"
        if name in ("MAX_REPEAT", "MIN_REPEAT"):
            if repeated:
                return "repeats a group that holds a repeat, which can take exponential time"
            low, high, _ = body
            if high == parser.MAXREPEAT:
                unbounded += 1
            elif high > BOUNDED_MOST:
                return f"repeats up to {high} times: at most {BOUNDED_MOST}, or unbounded (+ or *) once"
        if name == "BRANCH" and repeated:
            return "repeats a group of alternatives, which can take exponential time"
    if unbounded > 1:
        return "has more than one unbounded repeat (+ or *), which can take more than linear time: bound the others ({1,64})"
    return None


def walk(tree, parser, repeated):
    """(op, argument, inside a repeat) of every node of a parsed pattern, depth first."""
    for op, arg in tree:
        yield op, arg, repeated
        name = str(op).upper()
        if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            yield from walk(arg[2], parser, True)
        elif name == "SUBPATTERN":
            yield from walk(arg[-1], parser, repeated)
        elif name == "BRANCH":
            for branch in arg[1]:
                yield from walk(branch, parser, repeated)
        elif name in ("ATOMIC_GROUP",):
            yield from walk(arg, parser, repeated)


def checked_patterns(value) -> tuple[tuple | None, tuple[int | str, ...], str | None]:
    """The cluster file's `metrics:` as a run takes it: (None: off; (): the default forms; else
    ((fixed name or None, pattern), ...) read besides them), or where in it (list index, key) and
    why it cannot be."""
    if value is False:
        return None, (), None
    if value is None or value is True:
        return (), (), None
    if not isinstance(value, list):
        return None, (), "must be false, or a list of patterns (regular expressions with (?P<value>...))"
    items = []
    for i, item in enumerate(value):
        name, text = (item.get("name"), item.get("pattern")) if isinstance(item, dict) else (None, item)
        if isinstance(item, dict) and set(item) - {"name", "pattern"}:
            return None, (i,), "a pattern's keys are `pattern:` and `name:`"
        if not isinstance(text, str) or (name is not None and not (isinstance(name, str) and plain_name(name) == name)):
            return None, (i,), "must be a pattern (a string), or {name: NAME, pattern: PATTERN} with a plain name"
        why = pattern_problem(text) if name is None or "value" in text else "has no (?P<value>...) group"
        if why is None and name is None and "name" not in re.compile(text).groupindex:
            why = "has no (?P<name>...) group: give one, or `name:` the metric it reads"
        if why:
            return None, (i,), f"{text[:80]!r} {why}"
        items.append((name, text))
    return tuple(items), (), None
