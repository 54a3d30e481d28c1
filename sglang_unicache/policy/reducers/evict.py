"""Eviction: tokens not selected are dropped (the reduction of SnapKV, PyramidKV, H2O, AirCache)."""

from __future__ import annotations

from sglang_unicache.policy.catalog import reducer
from sglang_unicache.policy.reducers.base import keep_only


@reducer("evict")
class EvictReducer:
    """Keep the selected entries as exact copies; every other token of the span is evicted."""

    def reduce(self, ctx, layer, seg, kept, scores):
        return keep_only(kept, seg.length)
