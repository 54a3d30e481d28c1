"""Random scorer: a seeded, deterministic lower bound (same seed, layer and shape -> same plan).

Scores are drawn on the CPU from ``torch.Generator`` seeded with ``(seed, layer)`` and moved to the
inputs' device, so the plan does not depend on the device.
"""

from __future__ import annotations

import torch

from sglang_unicache.policy.catalog import method, scorer


@scorer("random")
class RandomScorer:
    seed: int = 0

    def score(self, ctx, layer):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + layer)
        h, t = ctx.inputs.num_kv_heads, ctx.inputs.num_tokens
        total, first = ctx.shards.heads(h)  # a tensor-parallel rank draws its heads' rows
        return torch.rand(total, t, generator=g)[first : first + h].to(ctx.inputs.device)


method("random", scorer="random", budget="uniform", reducer="evict",
       summary="seeded random selection (a floor)")
