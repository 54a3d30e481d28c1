"""Modality budgets by information density (UniCache seed §5.2), for ``compress_text`` mode.

1. Density proxy: mean pairwise cosine similarity of a modality's K/V (high similarity = redundant
   = low density). We use ``rho = 1 - mean similarity`` as the density, so that
2. ``R_v = R * rho_t / (rho_v + rho_t) * k`` and ``R_t = R * rho_v / (rho_v + rho_t) * k`` give the
   *less* dense modality the higher rate, with k chosen so the token-weighted mean rate is R.
3. Caps: R_v <= visual_rate_cap (0.8), R_t <= text_rate_cap (0.4); the excess tokens move to the
   other modality (which is capped too; whatever is left over is not compressed).

Mean pairwise cosine in O(n): for unit vectors u_i, ``sum_{i != j} u_i.u_j = |sum u|^2 - n``.
``modality_allocation = "fixed"`` uses the §8.1 rates (visual 0.70, text 0.25) with the same caps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def pairwise_cosine(x: torch.Tensor) -> torch.Tensor:
    """x ``[n, H, D]`` -> ``[H]`` mean pairwise cosine of the n tokens, per head."""
    n, h = x.shape[0], x.shape[1]
    if n < 2:
        return torch.zeros(h)
    u = F.normalize(x.float(), dim=-1)
    s = u.sum(dim=0)  # [H, D]
    return ((s * s).sum(-1) - n) / (n * (n - 1))


def density_rates(
    total_rate: float, rho_v: float, rho_t: float, n_v: int, n_t: int
) -> tuple[float, float]:
    """Uncapped (R_v, R_t) of §5.2 step 2, token-weighted mean = total_rate."""
    if rho_v + rho_t <= 0:
        return total_rate, total_rate
    sv, st = rho_t / (rho_v + rho_t), rho_v / (rho_v + rho_t)
    k = (n_v + n_t) / max(n_v * sv + n_t * st, 1e-12)  # seed's normaliser
    return total_rate * sv * k, total_rate * st * k


def cap_with_overflow(
    r_v: float, r_t: float, n_v: int, n_t: int, cap_v: float, cap_t: float
) -> tuple[float, float]:
    """Seed §5.2 step 3: clip each rate to its cap and move the excess tokens to the other."""
    if r_v > cap_v:
        extra = (r_v - cap_v) * n_v
        r_v = cap_v
        r_t = r_t + (extra / n_t if n_t else 0.0)
    if r_t > cap_t:
        extra = (r_t - cap_t) * n_t
        r_t = cap_t
        r_v = min(cap_v, r_v + (extra / n_v if n_v else 0.0))
    return r_v, r_t


@dataclass(frozen=True)
class ModalityBudget:
    """Parameters (seed §8.1): ``modality_allocation`` "density" (§5.2) or "fixed" (the rates
    below); ``visual_rate`` 0.70 / ``text_rate`` 0.25 (fixed allocation); ``visual_rate_cap`` 0.8
    / ``text_rate_cap`` 0.4 (both allocations)."""

    modality_allocation: str = "density"
    visual_rate: float = 0.70
    text_rate: float = 0.25
    visual_rate_cap: float = 0.8
    text_rate_cap: float = 0.4

    def keep(self, ctx, keep_ratio: float) -> tuple[float, float]:
        """(visual keep, text keep) for the request; density measured on the mean over layers."""
        vis = ctx.is_visual
        n_v, n_t = int(vis.sum()), int((~vis).sum())
        if self.modality_allocation == "fixed":
            r_v, r_t = self.visual_rate, self.text_rate
        else:
            sims_v, sims_t = [], []
            for li in range(ctx.num_layers):
                kv = torch.cat([ctx.keys(li), ctx.values(li)], dim=-1)
                sims_v.append(float(ctx.shards.mean(pairwise_cosine(kv[vis]))))
                sims_t.append(float(ctx.shards.mean(pairwise_cosine(kv[~vis]))))
            rho_v = max(1e-6, 1 - sum(sims_v) / len(sims_v))
            rho_t = max(1e-6, 1 - sum(sims_t) / len(sims_t))
            r_v, r_t = density_rates(1 - keep_ratio, rho_v, rho_t, n_v, n_t)
        r_v, r_t = cap_with_overflow(r_v, r_t, n_v, n_t, self.visual_rate_cap, self.text_rate_cap)
        return 1 - r_v, 1 - r_t
