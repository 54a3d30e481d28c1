"""StreamingLLM scorer (Xiao et al., 2024, "Efficient Streaming Language Models with Attention
Sinks"): keep the first tokens (the attention sinks) and the most recent ones, drop the middle.

Here the sequence is the span: its first ``N_SINK`` tokens, then the latest tokens of the span, as
kvpress's ``StreamingLLMPress`` does for a whole prompt (its ``n_sink`` default, 4). Position only:
no query, no key is read, so the same entries survive in every head and for every question.

Departure: StreamingLLM slides its window during decoding and re-rotates keys to their cache
positions; we apply the rule once, after prefill, to the image span, and keep original positions.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from sglang_unicache.policy.catalog import method, scorer


@scorer("streaming_llm")
class StreamingLLMScorer:
    N_SINK: ClassVar[int] = 4

    def score(self, ctx, layer):
        t = ctx.inputs.num_tokens
        score = torch.arange(t, dtype=torch.float32, device=ctx.inputs.device)  # later = higher
        for seg in ctx.segments:
            score[seg.start : seg.start + self.N_SINK] = float(t)  # sinks outrank every position
        return score.unsqueeze(0).expand(ctx.inputs.num_kv_heads, t)


method("streaming_llm", scorer="streaming_llm", budget="uniform", reducer="evict",
       summary="StreamingLLM: the span's first 4 tokens (sinks) and its latest, position only")
