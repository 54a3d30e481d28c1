"""The keep ratio's one owner (``policy/keep.py``): where a plan starts, how it escalates, where
it stops, and how far a re-compression shrinks a span."""

from __future__ import annotations

import pytest

from sglang_unicache.policy.keep import KeepRatio


def ladder(keep: KeepRatio) -> list[float]:
    level, levels = keep.start(), []
    while keep.can_escalate(level):
        level = keep.escalated(level)
        levels.append(level)
    return levels


def test_a_failed_check_climbs_by_sqrt_2_and_the_first_rung_stays_within_015x():
    levels = ladder(KeepRatio(keep_ratio=0.1, escalate_max_keep=0.4))
    assert [round(x, 4) for x in levels] == [0.1414, 0.2, 0.2828, 0.4]
    assert levels[-1] == 0.4  # the fourth rung is the cap itself, not a rung a hair below it
    for tokens in (64, 256, 1024):
        assert round(levels[0] * tokens) <= 0.15 * tokens


def test_escalate_factor_2_doubles_up_to_the_cap():
    assert ladder(KeepRatio(keep_ratio=0.1, escalate_max_keep=0.4, escalate_factor=2.0)) == [
        0.2, 0.4]


def test_the_dynamic_rate_replaces_the_start_and_a_start_above_the_cap_never_escalates():
    keep = KeepRatio(keep_ratio=0.6, escalate_max_keep=0.4)
    assert keep.start() == 0.6 and not keep.can_escalate(keep.start())
    assert keep.start(dynamic=0.25) == 0.25 and keep.highest == 0.6


def test_a_bounded_view_takes_no_rung_above_its_bound():
    keep = KeepRatio(keep_ratio=0.1, view_rungs=1, view_max_keep=0.15)
    assert keep.bounded and keep.start() == pytest.approx(0.1 * 2**0.5)
    assert not keep.can_escalate(keep.start()) and keep.top() == keep.start()  # 0.2 > 0.15
    assert [round(x, 4) for x in ladder(KeepRatio(keep_ratio=0.01, view_rungs=1,
                                                  view_max_keep=0.15))] == [
        0.02, 0.0283, 0.04, 0.0566, 0.08, 0.1131]  # 0.16 would pass the bound
    # a bound above the cap: the cap still ends the ladder; a start above the bound stays
    assert ladder(KeepRatio(keep_ratio=0.1, view_max_keep=1.0))[-1] == 0.4
    assert KeepRatio(keep_ratio=0.3, view_max_keep=0.15).top() == 0.3
    for unbounded in (None, 0.0):  # the policy alone, and the server without host copies
        keep = KeepRatio(keep_ratio=0.1, view_max_keep=unbounded)
        assert not keep.bounded and keep.top() == 0.4


def test_hopeless_levels_are_skipped_but_the_cap_is_always_planned():
    keep = KeepRatio(keep_ratio=0.05, escalate_max_keep=0.4)
    level, skipped = keep.climb(0.05, lambda level: level < 0.19)
    assert (round(level, 9), skipped) == (0.2, 4)
    assert keep.climb(0.05, lambda level: True) == (0.4, 6)
    assert keep.climb(0.05, lambda level: False) == (0.05, 0)


def test_a_view_starts_the_plan_rungs_up_the_ladder_and_rests_at_the_keep_ratio():
    keep = KeepRatio(keep_ratio=0.1, view_rungs=1)
    assert keep.start() == pytest.approx(0.1 * 2**0.5) and keep.start(dynamic=0.3) == 0.4
    assert keep.at_rest(9, 64) == 6  # the span goes back to the keep ratio's count at rest
    assert KeepRatio(keep_ratio=0.1, view_rungs=4).start() == 0.4  # exactly the cap
    assert KeepRatio(keep_ratio=0.1, view_rungs=9).start() == 0.4  # never past it
    assert KeepRatio(keep_ratio=0.6, view_rungs=1).start() == 0.6  # above the cap: unchanged
    assert KeepRatio(keep_ratio=0.1).start() == 0.1
