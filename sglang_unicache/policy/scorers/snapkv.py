"""SnapKV scorer (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation").

Importance = attention from the observation window (the last W prompt queries) to every earlier
key, averaged over the window and over the query heads of each KV head (GQA), then smoothed by a
1-D max pool over tokens (``pool_kernel``, default 7) so neighbours of a strong token survive with
it. Selection is per-head top-K (template in ``compressor.py``), eviction.

Departures: the paper pools with kernel 5-7 over the whole prefix; we pool across span edges too
but only ever rank inside one span. Ties inside a pooled plateau are broken by the raw score
(``+ 1e-3 * raw``) so the peak itself is never dropped in favour of its neighbours. The window
is what the engine captured (``obs_positions``).
"""

from __future__ import annotations

from sglang_unicache.policy.catalog import method, scorer
from sglang_unicache.policy.signals import max_pool_tokens


@scorer("snapkv", needs_queries=True, query_dependent=True)
class SnapKVScorer:
    pool_kernel: int = 7

    def score(self, ctx, layer):
        ctx.require_queries(self.name)
        raw = ctx.received(layer)
        return max_pool_tokens(raw, self.pool_kernel) + 1e-3 * raw


method("snapkv", scorer="snapkv", budget="uniform", reducer="evict", keeps_window=True,
       summary="SnapKV: pooled observation-window attention, same K per layer")
method("pyramidkv", scorer="snapkv", budget="pyramid", reducer="evict", keeps_window=True,
       summary="PyramidKV: SnapKV scores, budgets decreasing with depth")
