"""Alignment tokens and their protection (UniCache seed §5.3).

Seed: a text token whose attention concentrates on the image, or an image patch attended by text
tokens, is an alignment token when its cross-modal attention share exceeds 0.3; alignment tokens get
a compression discount of 0.5 (compressed at half the rate of the others).

Our reading, on the statistics we have (observation queries only):
- text token (observed queries only): share of its attention mass on image tokens >= threshold
  (the seed's "share", literally);
- image token: attention received from the text observation queries, averaged over layers and
  heads, divided by the strongest token of its span, >= threshold (a patch's share of *all*
  attention is ~1/N for N patches, so the literal share could never reach 0.3; we read it
  relative to the span's most attended patch).
Protection with discount: for a span with rate r = 1 - K/N, ``ceil(n_align * (1 - discount*r))``
alignment tokens (the strongest) are forced into the selection, never more than
``floor(alignment_max_share * K)`` of the smallest layer budget K (ours, default 0.5): the seed's
discount assumes alignment tokens are 5-15% of the sequence and a rate near 60%; at one or a few
entries per image its count exceeds the budget and the protected tokens took all of it, leaving
the unified score nothing to choose. Measured on the bundled model at keep 0.01 with recall
(BENCHMARKS, "Keep 0.01"): protection taking the one entry answered 70.0% / 10.0% (later / long),
the score choosing it 75.8% / 23.3%. Tokens the caller marks ``ScoreInputs.protected`` are always
forced (and raise the budget if needed: a protection recorded in the radix tree must hold).
"""

from __future__ import annotations

import math

import torch

Tensor = torch.Tensor


def alignment_scores(ctx) -> Tensor:
    """``[T]`` fp32 cross-modal score in [0, 1] (see module docstring); zeros without queries."""
    t = ctx.inputs.num_tokens
    out = torch.zeros(t, device=ctx.inputs.device)
    if not ctx.has_queries:
        return out
    mean = ctx.shards.mean  # over every rank's heads
    recv = torch.stack([mean(ctx.received_from_text(li)) for li in range(ctx.num_layers)]).mean(0)
    for s in ctx.inputs.spans:  # loop over images, not tokens
        seg = recv[s.start : s.end]
        out[s.start : s.end] = seg / seg.max().clamp_min(1e-12)
    share = torch.stack([mean(ctx.visual_share(li)) for li in range(ctx.num_layers)]).mean(0)
    text_q = ctx.query_is_text
    out[ctx.obs_positions[text_q]] = share[text_q]
    return out


def protected_count(n_align: int, k: int, n: int, discount: float, max_share: float) -> int:
    """Alignment tokens forced into a span's selection: ``ceil(n_align * (1 - discount * rate))``
    with ``rate = 1 - k/n``, at most ``floor(max_share * k)``."""
    rate = 1.0 - k / n
    cap = math.floor(max_share * k + 1e-9)
    return min(cap, math.ceil(n_align * (1.0 - discount * rate) - 1e-9))
