"""What the run learned, read from what its ranks print: every number a trainer prints as a metric
becomes a value with its step, with no change to the script (pure).

The forms trainers print, read by default:
    name=value pairs         a tqdm bar's postfix, Lightning's bar: ``loss=0.123, v_num=0``
    name: value              Keras, Guild's default: ``loss: 0.6931 - accuracy: 0.5000``
    dict or JSON             the HF Trainer's logs: ``{'loss': 0.69, 'learning_rate': 5e-05, 'epoch': 0.25}``
    step N name value        the README's demo: ``step 3 loss 6.4149``
and the cluster file's own patterns (``metrics:``), regular expressions with named groups ``name``
(or a fixed name), ``value`` and optionally ``step``.

A line is untrusted text: only its first LINE_MOST characters are read, every pattern here runs in
time linear in them (no nested quantifiers; names are bounded), names are plain and bounded,
values finite. Counters that are not metrics (a bar's rate, ``v_num``, a rank, a world size) are
not values; step counters (``step``, ``global_step``, ``iteration``, HF's ``epoch``) are the step.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..config.metricpatterns import plain_name

LINE_MOST = 2000  # characters of a line read for metrics
PAIRS_MOST = 64  # values read from one line

_NUM = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?|[-+]?(?:nan|inf)"
_NAME = r"[A-Za-z_][\w.\-/]{0,63}"
# each: a bounded name, a separator, a number not followed by more of a word or number
_EQUALS = re.compile(rf"(?<![\w.\-/])({_NAME})=({_NUM})(?![\w.:])")
# "using: 0 TPU cores": a number with a unit or a word after it is no metric (but "loss: 0.5 acc: 0.9" is)
_COLON = re.compile(rf"(?<![\w.\-/'\"])({_NAME}):[ \t]?({_NUM})(?![\w.:/])(?![ \t]+[A-Za-z_][\w.\-/]{{0,63}}(?![\w.\-/:]))")
_QUOTED = re.compile(rf"""['"]({_NAME})['"][ \t]*:[ \t]*['"]?({_NUM})['"]?(?![\w.])""")  # recent HF: '1.385' 
_STEP_WORDS = re.compile(rf"\bstep[ \t]+(\d{{1,12}})\b")
_NEXT_PAIR = re.compile(rf"[ \t,;|]{{1,8}}({_NAME})[ \t]{{1,8}}({_NUM})(?![\w.:/])")  # right after the step, one by one
# a progress bar's count ("Epoch 1:  50%|####     | 4/8 [00:01<00:01, 3.9it/s, loss=0.2]")
_BAR = re.compile(r"(\d{1,12})/(\d{1,12})(?: \[| \d{1,4}:\d\d)")  # tqdm's "4/8 [", rich's "4/8 0:00:01"
_EPOCH = re.compile(r"^Epoch (\d{1,9})\b", re.I)

STEP_NAMES = ("step", "global_step", "iteration", "iter", "epoch")  # the step, in this order of preference
NOT_METRICS = frozenset({"v_num", "rank", "local_rank", "global_rank", "node_rank", "world_size", "world", "pid",
                         "port", "seed", "attempt", "gpus", "gpu", "nproc", "total", "batch", "batches", "it",
                         "step", "global_step", "iteration", "iter", "epoch", "steps", "epochs", "max_steps",
                         "err", "errno", "code", "exitcode", "exit_code", "status", "line", "lineno", "fd", "timeout",
                         "version", "retries", "tries", "max_epochs", "num_epochs", "batch_size", "num_workers",
                         "devices", "num_nodes", "nodes", "workers"})
SOURCE_FILE = re.compile(r"\.(py|pyx|c|cc|cpp|cxx|h|hpp|cu|cuh|rs|go|java|js|ts)$")  # "socket.cpp:207": a place, no metric


@dataclass(frozen=True)
class Value:
    name: str
    value: float
    step: float | None  # the step the line names, or the bar's count; None: none (charted by time)


def finite(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


@dataclass(frozen=True)
class Pattern:
    """A pattern of the cluster file's `metrics:`: its regular expression (named groups ``value``,
    ``name`` unless ``fixed`` names the metric, ``step`` optional)."""

    regex: re.Pattern
    fixed: str | None = None


class MetricReader:
    """Values from lines, in the default forms and ``patterns``; ``defaults=False``: only those."""

    def __init__(self, patterns: tuple[Pattern, ...] = (), defaults: bool = True):
        self.patterns = patterns
        self.defaults = defaults

    def read(self, text: str) -> list[Value]:
        text = text[:LINE_MOST]
        pairs: dict[str, float] = {}
        steps: dict[str, float] = {}
        own_step: float | None = None
        for pattern in self.patterns:
            for m in pattern.regex.finditer(text):
                groups = m.groupdict()
                name = pattern.fixed or groups.get("name") or ""
                value = finite(groups.get("value") or "")
                if groups.get("step") is not None:
                    own_step = finite(groups["step"])
                if value is not None and plain_name(name):
                    pairs.setdefault(plain_name(name), value)
        if self.defaults:
            self.default_forms(text, pairs, steps)
        step = own_step if own_step is not None else next((steps[n] for n in STEP_NAMES if n in steps), None)
        if step is None and pairs:
            step = bar_count(text)
        return [Value(name, value, step) for name, value in pairs.items()
                if name.lower() not in NOT_METRICS and "/s" not in name and not SOURCE_FILE.search(name)]

    @staticmethod
    def default_forms(text: str, pairs: dict, steps: dict) -> None:
        found = []
        # each form only where its mark is: most lines a job prints have none (the cheap test first)
        for form, mark in ((_QUOTED, ":"), (_EQUALS, "="), (_COLON, ":")):
            if mark in text:
                found += [(m.group(1), m.group(2)) for m in form.finditer(text)]
        step_words = _STEP_WORDS.search(text) if "step" in text else None
        if step_words:  # "step 3 loss 6.4149": the step, then name value pairs
            steps["step"] = float(step_words.group(1))
            at = step_words.end()
            while len(found) < PAIRS_MOST:
                pair = _NEXT_PAIR.match(text, at)
                if pair is None:
                    break
                found.append((pair.group(1), pair.group(2)))
                at = pair.end()
        for raw, number in found:
            name, value = plain_name(raw), finite(number)
            if not name or value is None:
                continue
            if name.lower() in STEP_NAMES:
                steps.setdefault(name.lower(), value)
            else:
                pairs.setdefault(name, value)


def bar_count(text: str) -> float | None:
    """A progress bar's count as the step ("4/8 [": 4), across epochs where the bar names its
    epoch as Lightning's does ("Epoch 1: ... 4/8 [": 12)."""
    bar = _BAR.search(text)
    if bar is None:
        return None
    count, total = int(bar.group(1)), int(bar.group(2))
    epoch = _EPOCH.match(text)
    return float(int(epoch.group(1)) * total + count if epoch else count)


def patterns_of(items) -> tuple[Pattern, ...]:
    """The cluster file's checked `metrics:` patterns (each a regex text, or (name, regex text))."""
    return tuple(Pattern(re.compile(text), name) for name, text in items)
