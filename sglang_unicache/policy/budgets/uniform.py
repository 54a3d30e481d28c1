"""Uniform budget: every layer keeps K = max(1, round(keep * N)) entries (SnapKV, H2O)."""

from __future__ import annotations

import torch

from sglang_unicache.policy.budgets.base import LayerBudget
from sglang_unicache.policy.catalog import budget


@budget("uniform")
class UniformBudget(LayerBudget):

    def layer_factors(self, ctx):
        return torch.ones(ctx.num_layers)


@budget("full", keeps_everything=True)
class FullBudget(LayerBudget):
    """Every layer keeps the whole span (identity)."""

    def layer_factors(self, ctx):
        return torch.ones(ctx.num_layers)

    def allocate(self, ctx, seg, keep):
        return torch.full((ctx.num_layers,), seg.length, dtype=torch.long)
