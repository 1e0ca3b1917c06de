"""The report's readers on damaged and planted run folders: generated input (Hypothesis) for every
file the page reads, and the faces found by hand. Nothing raises, every field that reaches the
page has the type it is drawn with, and no folder makes a page larger than a run could."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.views import runfields
from orchestrator.views.charts import figures
from orchestrator.views.report import render
from orchestrator.views.rundata import load
from orchestrator.views.timeline import NAME as TIMELINE

SCALARS = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=20)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                        max_size=4), max_leaves=12)
FIELDS = sorted({name for needed, others in runfields.KINDS.values() for name in (*needed, *others)} | {"points"})
POINT = st.lists(st.lists(SCALARS, max_size=4) | SCALARS, max_size=4)
LINE = st.fixed_dictionaries({"kind": st.sampled_from([*runfields.KINDS, "other", 3])},
                             optional={name: POINT if name == "points" else JSON for name in FIELDS})
SUMMARY = st.fixed_dictionaries({}, optional={
    "exit_code": JSON, "interrupted_by": JSON, "started": JSON, "world_size": JSON, "master": JSON, "script": JSON,
    "root_cause": st.fixed_dictionaries({}, optional={k: JSON for k in ("host", "node", "rank", "what", "exception",
                                                                          "traceback")}) | JSON,
    "nodes": st.lists(st.fixed_dictionaries({}, optional={"host": JSON, "node": JSON, "torch": JSON,
                                                          "gpus": st.lists(JSON | st.fixed_dictionaries(
                                                              {}, optional={"index": JSON, "name": JSON, "said": JSON}),
                                                              max_size=3)}) | JSON, max_size=3) | JSON})
RUN = st.fixed_dictionaries({}, optional={"command": JSON, "cwd": JSON, "git": JSON | st.fixed_dictionaries(
    {}, optional={"commit": JSON, "branch": JSON, "dirty": JSON}), "versions": JSON})


def folder(where, lines: list, summary, run) -> None:
    (where / TIMELINE).write_text("\n".join(json.dumps(line) for line in lines))
    (where / "summary.json").write_text(json.dumps(summary))
    (where / "run.json").write_text(json.dumps(run))


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(lines=st.lists(LINE, max_size=8), summary=SUMMARY | JSON, run=RUN | JSON)
def test_any_run_folder_is_read_with_every_field_of_its_type(tmp_path, lines, summary, run):
    folder(tmp_path, lines, summary, run)
    data = load(str(tmp_path))
    for record in data.records:
        assert record == runfields.timeline_line(record)  # checked once: checking again changes nothing
    figures(data)  # every chart made from what was kept


@settings(max_examples=15, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(lines=st.lists(LINE, max_size=6), summary=SUMMARY, run=RUN)
def test_any_run_folder_makes_a_page(tmp_path, lines, summary, run):
    folder(tmp_path, lines, summary, run)
    assert render(load(str(tmp_path))).endswith("</html>\n")


@pytest.mark.parametrize("where, text", [
    (TIMELINE, "[" * 1_000_000 + "]" * 1_000_000),
    ("summary.json", "[" * 1_000_000 + "]" * 1_000_000),
    (TIMELINE, json.dumps({"kind": "end", "t": "soon", "exit_status": 1})),
    (TIMELINE, json.dumps({"kind": "lines", "rank": "0", "node": "a", "points": [[1, 2]]}) + "\n" +
     json.dumps({"kind": "lines", "rank": 1, "node": "b", "points": [[1, 2]]})),
    ("run.json", json.dumps({"command": 5, "git": "x", "versions": [1]})),
    ("summary.json", json.dumps({"nodes": 7, "root_cause": {"traceback": 5, "node": "x"}})),
    (TIMELINE, json.dumps({"kind": "attempt", "attempt": 0, "start": 0, "end": 1e308, "next": 4, "nodes": 3})),
    (TIMELINE, json.dumps({"kind": "state", "t": 1e308, "node": "a", "state": "running"})),
    (TIMELINE, '{"kind": "progress", "rank": 0, "points": [[0, 1, Infinity], [1, NaN, 2]]}'),
], ids=["nested-timeline", "nested-summary", "end-time-text", "rank-text", "command-number", "nodes-number",
        "next-number", "time-1e308", "infinity-nan"])
def test_the_faces_found_by_hand_are_read_without_a_traceback(tmp_path, where, text):
    (tmp_path / where).write_text(text)
    page = render(load(str(tmp_path)))
    assert "1e+308" not in page and "Infinity" not in page.split("<body>")[1]


def test_planted_lines_past_what_a_run_writes_are_left_out_and_counted(tmp_path):
    long = json.dumps({"kind": "state", "t": 1, "node": "n" * 50, "state": "running", "reason": "r" * 5000})
    state = json.dumps({"kind": "state", "t": 1, "node": "n", "state": "running", "reason": "r"})
    (tmp_path / TIMELINE).write_text("\n".join([long] + [state] * (runfields.MOST["state"] + 500)))
    data = load(str(tmp_path))
    assert len(data.kind("state")) == runfields.MOST["state"]
    assert f"501 state line(s) of {TIMELINE} past the first 20,000, left out" in data.missing
    assert len(data.kind("state")[0]["reason"]) == runfields.TEXT_MOST


def test_direction_overrides_and_markup_reach_neither_page_nor_screen(tmp_path):
    from orchestrator.clean import safe_text

    evil = "exe.\u202egnp <a href=x>link</a> \u2066x\u2069"
    (tmp_path / TIMELINE).write_text("\n".join(json.dumps(x) for x in (
        {"kind": "attempt", "attempt": 0, "start": 0, "end": 2, "nodes": [evil], "end_why": evil, "cause": evil},
        {"kind": "state", "t": 0, "node": evil, "attempt": 0, "state": "running", "reason": evil})))
    page = render(load(str(tmp_path)))
    assert not any(c in page for c in "\u202e\u2066\u2069") and "<a href=x>" not in page
    assert not any(c in safe_text(evil) for c in "\u202e\u2066\u2069")
