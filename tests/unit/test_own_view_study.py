"""The offline replay of the self-check's policies (benchmarks/quality/own_view_study.py)."""

from benchmarks.quality.own_view_study import Level, entries, replay, summary


def test_replay_takes_the_first_passing_rung_and_the_full_kv_past_the_last():
    full = [1, 1, 0]
    lv = {
        0.1: Level(0.1, [0, 1, 0], [{"kl": 1.2}, {"kl": 0.3}, {"kl": 2.0}]),
        0.14: Level(0.14, [1, 1, 1], [{"kl": 0.8}, {"kl": 0.2}, {"kl": 1.5}]),
        0.4: Level(0.4, [1, 1, 1], [{"kl": 0.1}, {"kl": 0.1}, {"kl": 1.0}]),
    }
    assert replay(lv, full, "kl", 0.9, (0.1, 0.14, 0.4)) == [(0.14, 1), (0.1, 1), (1.0, 0)]
    assert replay(lv, full, "kl", float("inf"), (0.1,)) == [(0.1, 0), (0.1, 1), (0.1, 0)]
    s = summary(replay(lv, full, "kl", 0.9, (0.1, 0.14, 0.4)), 64)
    assert entries(0.14, 64) == 9 and entries(0.2, 64) == 13
    assert s["within_bound"] == 2 / 3 and s["full_kv"] == 1 and s["accuracy"] == 2 / 3
    assert s["mean_entries"] == (9 + 6 + 64) / 3
