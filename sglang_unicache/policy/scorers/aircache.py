"""AirCache scorer: visual importance from the Elite Observation Window (key design 1).

Seed procedure, per layer:
1. Text self-attention of the last text token: ``Att = softmax(q_last K_t^T / sqrt(D))`` over text
   keys only.
2. Elite window ``k = {j | Att[j] >= alpha * max Att}`` (alpha = 0.9).
3. Attention of the elite queries over ``[visual keys ; elite text keys]``:
   ``A = softmax(Q_tk K_vtk^T / sqrt(D))``.
4. Visual importance ``I_v = mean over elite queries of A[:, visual columns]``.

Departures (the engine captures only the queries of the last W prompt positions):
- The elite set can only contain text tokens whose queries we have: candidates are the observation
  positions that are text, and the threshold is ``alpha * max`` over those candidates (the seed's
  max over *all* text tokens is often an attention sink with no captured query, which would leave
  the window empty). The last text token is always a candidate, so the window is never empty.
- Computed per KV head (query heads of a group averaged), causal mask applied.
- If no observation query is text, all observation queries form the window.
Text tokens score 0 (AirCache compresses visual KV only).
"""

from __future__ import annotations

import torch

from sglang_unicache.policy.catalog import method, scorer

Tensor = torch.Tensor


def elite_window(ctx, layer: int, alpha: float) -> Tensor:
    """``[H, W]`` bool: observation queries in the elite window of each KV head."""
    is_text = ctx.query_is_text
    h, w = ctx.inputs.num_kv_heads, is_text.numel()
    if not bool(is_text.any()):
        return torch.ones(h, w, dtype=torch.bool, device=is_text.device)
    last = int(torch.nonzero(is_text).max())
    rows = slice(last, last + 1)
    lse = ctx.window_lse(layer, ctx.text_mask, rows)
    att = ctx.window_colsum(layer, lse, ctx.text_mask, None, rows)  # [H, T]
    cand = att[:, ctx.obs_positions]  # [H, W]
    cand = torch.where(is_text, cand, torch.full_like(cand, -1.0))
    return (cand >= alpha * cand.amax(dim=1, keepdim=True)) & is_text


def elite_importance(ctx, layer: int, alpha: float) -> Tensor:
    """``[H, T]`` visual importance I_v (0 on text columns), cached on the context (the AirCache
    budget reads it too)."""

    def fn() -> Tensor:
        ctx.require_queries("aircache")
        h, t = ctx.inputs.num_kv_heads, ctx.inputs.num_tokens
        elite = elite_window(ctx, layer, alpha)  # [H, W]
        elite_cols = torch.zeros(h, t, dtype=torch.bool, device=elite.device)
        elite_cols[:, ctx.obs_positions] = elite
        cols = elite_cols | ctx.is_visual.unsqueeze(0)
        rw = elite.float()
        s = ctx.window_colsum(layer, ctx.window_lse(layer, cols), cols, rw)
        s = s / (rw.sum(dim=1, keepdim=True).clamp_min(1.0) * ctx.group)
        return s * ctx.is_visual.float()

    return ctx.cached(f"aircache_importance_{alpha}", layer, fn)


@scorer("aircache", prefix="aircache_", needs_queries=True, query_dependent=True)
class AirCacheScorer:
    """alpha: the elite window's threshold, a fraction of the strongest candidate (seed: 0.9)."""

    alpha: float = 0.9

    def score(self, ctx, layer):
        return elite_importance(ctx, layer, self.alpha)


method("aircache", scorer="aircache", budget="aircache", reducer="evict",
       summary="AirCache: elite observation window, strength + skewness budgets (ICCV 2025)")
