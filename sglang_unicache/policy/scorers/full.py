"""Identity: keeps every token (with the ``full`` budget); the quality upper bound."""

from __future__ import annotations

import torch

from sglang_unicache.policy.catalog import method, scorer


@scorer("full")
class FullScorer:

    def score(self, ctx, layer):
        return torch.zeros(ctx.inputs.num_kv_heads, ctx.inputs.num_tokens, device=ctx.inputs.device)


method("full", scorer="full", budget="full", reducer="evict",
       summary="identity: nothing compressed (token-identical to stock)")
