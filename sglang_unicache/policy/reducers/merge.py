"""Merge reduction (UniCache seed §6.1-§6.2): fold redundant evicted tokens into kept entries.

Seed §6.1 bands on the neighbour redundancy d (``PlanContext.redundancy``): d > merge_threshold
(0.8) -> merge, evict_low <= d <= evict_high (0.5-0.8) with a low score -> evict, the rest kept.
Here the budget fixes *how many* entries survive (exactly K per layer), the selection decides
*which*, and this reducer decides what happens to the others:

* d > merge_threshold and cosine to its most similar kept entry >= evict_low -> merged into that
  entry (we refuse to fold a token into a dissimilar entry: it would corrupt it);
* everything else not kept -> evicted (the seed's evict band, and, departure, also non-redundant
  low-score tokens when the budget is smaller than the seed's "keep" band).

Merge weights (§6.2): the members' importance scores, min-max normalised within the span per head
(plus 1e-3 so no member has weight 0), normalised within each entry; K and V use the same weights;
the executor restores the merged vector's norm to the members' weighted mean norm.
"""

from __future__ import annotations

import torch

from sglang_unicache.policy.catalog import reducer
from sglang_unicache.policy.reducers.base import keep_only
from sglang_unicache.policy.signals import masked_minmax


@reducer("merge", merges=True)
class MergeReducer:
    """merge_threshold: redundancy d above which an evicted token may merge (seed: 0.8);
    evict_low: the least cosine to its kept entry a merged token needs (seed's evict band: 0.5)."""

    merge_threshold: float = 0.8
    evict_low: float = 0.5

    def reduce(self, ctx, layer, seg, kept, scores):
        assign, weight = self.reduce_layers(ctx, [layer], seg, kept[None], scores[None])
        return assign[0], weight[0]

    def reduce_layers(self, ctx, layers, seg, kept, scores):
        """``reduce`` of every layer of ``layers`` at once: kept ``[g, H, K]`` and scores
        ``[g, H, N]`` in, ``(assign, weight)`` ``[g, H, N]`` out, each layer's the one it gets
        alone (the nearest kept entry is searched over the rows any layer needs; each row's
        maximum is the same whatever the other rows)."""
        n = seg.length
        g, h, k = kept.shape
        assign, _ = keep_only(kept, n)
        if k == n:
            return assign, (assign >= 0).float()
        sl = slice(seg.start, seg.end)
        d = torch.stack([ctx.redundancy(li)[:, sl] for li in layers])  # [g, H, N]
        candidate = (assign < 0) & (d > self.merge_threshold)  # evicted and redundant
        rows = candidate.any(1).any(0).nonzero().flatten()
        if rows.numel() == 0:
            return assign, merge_weights(scores, assign, k)
        heads = torch.arange(h, device=kept.device)
        sims, nears = [], []
        for i, li in enumerate(layers):  # one product per layer: no copy of the stacked K/V
            x = ctx.unit_kv(li)[sl]  # [N, H, 2D]
            xk = x[kept[i].T, heads]  # [K, H, 2D]
            # Only the candidate rows need their most similar kept entry.
            xr = x.index_select(0, rows).transpose(0, 1)  # [H, R, 2D]
            sim, near = torch.bmm(xr, xk.permute(1, 2, 0)).max(dim=-1)  # [H, R]
            sims.append(sim)
            nears.append(near)
        sim, near = torch.stack(sims), torch.stack(nears)
        best_sim = torch.full((g, h, n), -2.0, device=sim.device).index_copy_(2, rows, sim)
        best = torch.zeros(g, h, n, dtype=near.dtype, device=near.device).index_copy_(2, rows,
                                                                                      near)
        merge = candidate & (best_sim >= self.evict_low)
        assign = torch.where(merge, best.to(torch.int32), assign)
        return assign, merge_weights(scores, assign, k)


def merge_weights(scores: torch.Tensor, assign: torch.Tensor, k: int) -> torch.Tensor:
    """Importance weights normalised within each entry: ``[..., H, N]`` fp32, 0 for evicted
    tokens."""
    imp = masked_minmax(scores.float(), None)
    imp = imp + 1e-3
    valid = assign >= 0
    imp = torch.where(valid, imp, torch.zeros_like(imp))
    idx = assign.long().clamp_min(0)
    total = torch.zeros(*scores.shape[:-1], k, device=scores.device).scatter_add_(-1, idx, imp)
    return torch.where(valid, imp / total.gather(-1, idx).clamp_min(1e-12), torch.zeros_like(imp))
