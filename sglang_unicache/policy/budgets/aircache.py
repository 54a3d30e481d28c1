"""AirCache layer budget from strength and skewness (AirCache, key design 2).

Per layer, on the visual importance I_v of the elite window (``scorers/aircache.py``; mean over
KV heads):
- strength ``s_t = sum_i I_v[i]`` over the image tokens;
- skewness ``s_k = n / ((n-1)(n-2)) * sum_i ((I_v[i] - mean) / std)^3`` (sample skewness, std with
  n-1), n = number of image tokens;
- each normalised across layers, ``r_hat = 1/2 (s_t' + s_k') * r``, rescaled so the layers' total
  equals the requested total (``apportion``).

Departure: the seed does not say how s' is normalised; we min-max each across layers to [0, 1]
and add ``aircache_floor`` (0.1) so that no layer is starved to one entry by a min-max zero; equal
values across layers give uniform budgets. Per-span budgets use the same layer factors (computed
over all image tokens of the request, as the seed does).
"""

from __future__ import annotations

import torch

from sglang_unicache.policy.budgets.base import LayerBudget
from sglang_unicache.policy.catalog import budget
from sglang_unicache.policy.scorers.aircache import elite_importance


def sample_skewness(x: torch.Tensor) -> torch.Tensor:
    """Seed formula on the last dim of ``x [..., n]`` (n >= 3); 0 for a constant vector."""
    x = x.double()
    n = x.shape[-1]
    mu = x.mean(dim=-1, keepdim=True)
    sd = x.std(dim=-1, keepdim=True)
    z = torch.where(sd > 0, (x - mu) / sd.clamp_min(1e-300), torch.zeros_like(x))
    return n / ((n - 1) * (n - 2)) * (z**3).sum(dim=-1)


def minmax_across_layers(x: torch.Tensor) -> torch.Tensor:
    span = x.max() - x.min()
    if float(span) <= 0:
        return torch.ones_like(x)
    return (x - x.min()) / span


def aircache_factors(strength: torch.Tensor, skew: torch.Tensor, floor: float) -> torch.Tensor:
    """``[L]`` factors ``1/2 (s_t' + s_k') + floor``."""
    return 0.5 * (minmax_across_layers(strength) + minmax_across_layers(skew)) + floor


@budget("aircache", prefix="aircache_", needs_queries=True)
class AirCacheBudget(LayerBudget):
    """alpha: the elite window's threshold (``scorers/aircache.py``, seed: 0.9); floor: added to
    the normalised layer scores (ours, 0.1)."""

    alpha: float = 0.9
    floor: float = 0.1

    def layer_factors(self, ctx):
        vis = ctx.is_visual
        if int(vis.sum()) < 3:
            return torch.ones(ctx.num_layers)
        iv = torch.stack(
            [ctx.shards.mean(elite_importance(ctx, li, self.alpha))[vis]
             for li in range(ctx.num_layers)]
        )
        return aircache_factors(iv.sum(dim=1).double().cpu(), sample_skewness(iv).cpu(), self.floor)
