"""Compressed span ids: one per kept entry, equal for the same image and config, never starting
like another span's (the radix tree tells children apart by their first token, so a span can
only ever be matched whole, never split inside)."""

from __future__ import annotations

from sglang_unicache.engine.spans import SpanNaming
from sglang_unicache.policy.config import UniCacheConfig


def naming(**overrides) -> SpanNaming:
    return SpanNaming.of(UniCacheConfig(**{"method": "knorm", "keep_ratio": 0.25, **overrides}))


def test_same_image_same_config_same_ids():
    a, b = naming(), naming()
    assert a.ids(123456789, 4, 16) == b.ids(123456789, 4, 16)


def test_ids_are_consecutive_wide_and_valid_int64():
    ids = naming().ids(987654321, 4, 26)
    assert list(ids) == list(range(ids[0], ids[0] + 26))
    assert 1_000_000 <= ids[0] and ids[-1] < 2**63


def test_different_images_positions_and_configs_never_share_a_first_id():
    firsts = set()
    configs = [naming(), naming(keep_ratio=0.1), naming(observation_window=8)]
    for ctl in configs:
        for pad in range(2000):
            for start in (4, 30):
                firsts.add(ctl.ids(10**12 + pad, start, 16)[0])
    assert len(firsts) == len(configs) * 2000 * 2
