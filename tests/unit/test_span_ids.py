"""Compressed span ids: one per kept entry, equal for the same image and config, never starting
like another span's (the radix tree tells children apart by their first token, so a span can
only ever be matched whole, never split inside)."""

from __future__ import annotations

import torch

from sglang_unicache.config import UniCacheConfig
from sglang_unicache.integration.controller import Controller


def controller(**overrides) -> Controller:
    config = UniCacheConfig(**{"method": "knorm", "keep_ratio": 0.25, **overrides})
    return Controller(config, torch.zeros(1, 1, dtype=torch.int32), kv_pool=None, allocator=None)


def test_same_image_same_config_same_ids():
    a, b = controller(), controller()
    assert a.compressed_ids(123456789, 4, 16) == b.compressed_ids(123456789, 4, 16)


def test_ids_are_consecutive_wide_and_valid_int64():
    ids = controller().compressed_ids(987654321, 4, 26)
    assert list(ids) == list(range(ids[0], ids[0] + 26))
    assert 1_000_000 <= ids[0] and ids[-1] < 2**63


def test_different_images_positions_and_configs_never_share_a_first_id():
    firsts = set()
    configs = [controller(), controller(keep_ratio=0.1), controller(observation_window=8)]
    for ctl in configs:
        for pad in range(2000):
            for start in (4, 30):
                firsts.add(ctl.compressed_ids(10**12 + pad, start, 16)[0])
    assert len(firsts) == len(configs) * 2000 * 2
