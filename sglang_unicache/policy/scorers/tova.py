"""TOVA scorer (Oren et al., 2024, "Transformers are Multi-State RNNs"): keep the tokens the
current query attends to most. TOVA evicts, at every step, the token with the lowest attention
weight from the last position, averaged over the layer's heads, so all heads keep the same tokens.

At prefill the last prompt position is the current query: score = its attention to every key,
averaged over every query head of the layer (a GQA group's heads included), the same for every KV
head. Selection is per-head top-K by the template (``compressor.py``), which with identical
scores keeps the same tokens in every head, as TOVA does; eviction.

Departure: TOVA evicts one token per decoding step; we apply its rule once, after prefill, to the
image span only (the one-shot form kvpress also uses).
"""

from __future__ import annotations

from sglang_unicache.policy.catalog import method, scorer


@scorer("tova", needs_queries=True, query_dependent=True)
class TOVAScorer:

    def score(self, ctx, layer):
        ctx.require_queries(self.name)
        last = slice(-1, None)  # the last observation query: the last prompt position
        received = ctx.window_colsum(layer, ctx.window_lse(layer, rows=last), rows=last)  # [H, T]
        return ctx.shards.mean(received).unsqueeze(0).expand_as(received)


method("tova", scorer="tova", budget="uniform", reducer="evict",
       summary="TOVA: the last position's head-averaged attention, same tokens in every head")
