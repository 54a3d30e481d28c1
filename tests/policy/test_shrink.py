"""Re-compression of a compressed span to a smaller budget (sglang_unicache.policy.shrink)."""

from __future__ import annotations

import pytest
import torch

from sglang_unicache.policy.config import UniCacheConfig
from sglang_unicache.policy.keep import KeepRatio
from sglang_unicache.policy.registry import build_method
from sglang_unicache.policy.shrink import shrink_order
from tests.policy.conftest import make_inputs


def test_shrunk_count_halves_down_to_the_floor():
    counts, k = [], 26
    while True:
        nxt = KeepRatio(recompress_factor=0.5, recompress_floor=0.02).shrunk(k, original=256)
        if nxt == k:
            break
        counts.append(k := nxt)
    assert counts == [13, 7, 6]  # floor: ceil(256 * 0.02) = 6


@pytest.mark.parametrize("method", ["snapkv", "unicache", "knorm"])
def test_plan_priorities_shrink_to_the_same_set_a_smaller_budget_selects(method):
    """Re-compressing a keep-0.4 plan to 0.2 by its priorities keeps what a keep-0.2 plan of the
    same request keeps (same scores, same tie-breaking), protected tokens included."""
    inputs = make_inputs(protected=(10, 70))
    config = UniCacheConfig(method=method, selfcheck=False, layer_fill="next",
                            protect_alignment=False, anchor_fraction=0.0)
    big = build_method(config.replace(keep_ratio=0.4)).plan(inputs).spans[0]
    small = build_method(config.replace(keep_ratio=0.2)).plan(inputs).spans[0]
    for lp_big, lp_small in zip(big.layers, small.layers, strict=True):
        assert lp_big.priority is not None and lp_big.priority.shape == lp_big.kept.shape
        keep = shrink_order(lp_big.priority, lp_small.num_kept)
        shrunk = lp_big.kept.gather(1, keep)
        assert torch.equal(shrunk, lp_small.kept)
        assert (shrunk == 10 - big.span.start).any(1).all()  # token 10 is in span 0 (4..54)


def test_shrink_order_rejects_growing():
    with pytest.raises(ValueError):
        shrink_order(torch.zeros(2, 4), 5)
