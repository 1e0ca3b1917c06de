import pytest

from orchestrator.views.filters import Collapser, RankSpecError, format_ranks, parse_ranks


def test_parse_and_format_ranks():
    assert parse_ranks("0,3-5", 8) == {0, 3, 4, 5}
    assert parse_ranks(" 7 ", 8) == {7}
    assert format_ranks({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"


@pytest.mark.parametrize("spec", ["", "a", "3-1", "8", "0,,1", "-1"])
def test_bad_rank_lists_are_usage_errors(spec):
    with pytest.raises(RankSpecError) as info:
        parse_ranks(spec, 8)
    assert info.value.exit_code == 2


def test_line_from_every_rank_comes_out_once():
    c = Collapser(world_size=3)
    assert c.add("out", 0, "banner", 0.0) == []
    assert c.add("out", 2, "banner", 0.1) == []
    assert c.add("out", 1, "banner", 0.2) == [("out", frozenset({0, 1, 2}), "banner")]
    assert c.pending == {}


def test_partial_lines_are_released_after_the_window_and_never_lost():
    c = Collapser(world_size=4, window=0.5)
    c.add("out", 0, "a", 0.0)
    c.add("out", 1, "a", 0.1)
    c.add("err", 1, "b", 0.3)
    assert c.due(0.4) == []
    assert c.due(0.55) == [("out", frozenset({0, 1}), "a")]
    assert c.due(1.0, everything=True) == [("err", frozenset({1}), "b")]


def test_a_rank_repeating_itself_is_not_merged():
    c = Collapser(world_size=2)
    c.add("out", 0, "tick", 0.0)
    assert c.add("out", 0, "tick", 0.1) == [("out", frozenset({0}), "tick")]
    assert c.add("out", 1, "tick", 0.2) == [("out", frozenset({0, 1}), "tick")]
