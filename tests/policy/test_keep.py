"""The keep ratio's one owner (``policy/keep.py``): where a plan starts, how it escalates, where
it stops, and how far a re-compression shrinks a span."""

from __future__ import annotations

from sglang_unicache.policy.keep import KeepRatio


def test_a_failed_check_doubles_the_ratio_up_to_the_cap():
    keep, levels = KeepRatio(keep_ratio=0.1, escalate_max_keep=0.4), []
    level = keep.start()
    while keep.can_escalate(level):
        level = keep.escalated(level)
        levels.append(level)
    assert levels == [0.2, 0.4]


def test_the_dynamic_rate_replaces_the_start_and_a_start_above_the_cap_never_escalates():
    keep = KeepRatio(keep_ratio=0.6, escalate_max_keep=0.4)
    assert keep.start() == 0.6 and not keep.can_escalate(keep.start())
    assert keep.start(dynamic=0.25) == 0.25 and keep.highest == 0.6


def test_hopeless_levels_are_skipped_but_the_cap_is_always_planned():
    keep = KeepRatio(keep_ratio=0.05, escalate_max_keep=0.4)
    assert keep.climb(0.05, lambda level: level < 0.2) == (0.2, 2)
    assert keep.climb(0.05, lambda level: True) == (0.4, 3)
    assert keep.climb(0.05, lambda level: False) == (0.05, 0)
