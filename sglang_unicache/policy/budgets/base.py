"""Contract of a layer budget (the "how many per layer" axis).

A budget turns a span's total entry count into per-layer counts ``K_l`` (identical across the heads
of a layer). Most budgets only define ``layer_factors(ctx) -> [L]`` (positive, any scale): the
share of each layer. ``allocate`` then apportions exactly ``L * K`` entries, ``K = max(1,
round(keep * N))``, with ``1 <= K_l <= N`` (``apportion``), so the *average* keep ratio over
layers is the requested one. The physical slots a span needs are ``max_l K_l``: a pool slot spans
every layer (``docs/policy.md``, "Honest memory accounting").
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from sglang_unicache.policy.context import PlanContext
    from sglang_unicache.policy.inputs import ImageSpan

Tensor = torch.Tensor


def apportion(total: int, weights: Tensor, lo: int, hi: int) -> Tensor:
    """Integers ``k_l`` in ``[lo, hi]`` summing to ``clamp(total, L*lo, L*hi)``, proportional to
    ``weights`` where the bounds allow (water filling, then largest remainders).
    Returns CPU int64 ``[L]``.

    Memoised on its arguments: a request asks for the same budgets at every escalation level
    it tries, and requests with images of one size under a query-free budget ask for the same
    ones, while the bisection below costs a hundred small tensor ops (it was the largest single
    cost of planning a 256-token image on a 2-layer model)."""
    w = tuple(weights.detach().double().cpu().tolist())
    return torch.tensor(_apportion(int(total), w, int(lo), int(hi)), dtype=torch.long)


@functools.lru_cache(maxsize=4096)
def _apportion(total: int, weights: tuple[float, ...], lo: int, hi: int) -> tuple[int, ...]:
    w = torch.tensor(weights, dtype=torch.float64).clamp_min(0)
    n = w.numel()
    total = max(n * lo, min(n * hi, int(total)))
    if float(w.sum()) <= 0:
        w = torch.ones_like(w)
    lo_c, hi_c = 0.0, float(hi) / max(float(w[w > 0].min()), 1e-300) + 1.0
    for _ in range(100):  # bisection on the scale c of sum(clamp(c*w, lo, hi)) = total
        mid = 0.5 * (lo_c + hi_c)
        if float((mid * w).clamp(lo, hi).sum()) < total:
            lo_c = mid
        else:
            hi_c = mid
    x = (hi_c * w).clamp(lo, hi)
    k = x.floor()
    rem = int(total - k.sum())
    frac = x - k
    if rem > 0:
        frac = torch.where(k < hi, frac, torch.full_like(frac, -1.0))
        k[torch.argsort(frac, descending=True, stable=True)[:rem]] += 1
    elif rem < 0:
        frac = torch.where(k > lo, frac, torch.full_like(frac, 2.0))
        k[torch.argsort(frac, stable=True)[:-rem]] -= 1
    return tuple(k.long().tolist())


class LayerBudget:
    """Base class: subclasses are frozen dataclasses whose fields are their parameters; they set
    ``name`` and implement ``layer_factors``."""

    name: ClassVar[str] = "base"
    needs_queries: ClassVar[bool] = False  # capability: reads observation-window statistics
    keeps_everything: ClassVar[bool] = False  # capability: the identity budget (no work done)

    def layer_factors(self, ctx: PlanContext) -> Tensor:
        raise NotImplementedError

    def allocate(self, ctx: PlanContext, seg: ImageSpan, keep: float) -> Tensor:
        """``[L]`` int64 per-layer entry counts for ``seg`` at keep ratio ``keep``."""
        n = seg.length
        base = min(n, max(1, round(keep * n)))
        factors = self._factors(ctx)
        return apportion(base * factors.numel(), factors, 1, n)

    def _factors(self, ctx: PlanContext) -> Tensor:
        return ctx.cached(f"budget_{self.name}", -1, lambda: self.layer_factors(ctx))
