"""Uniform budget: every layer keeps K = max(1, round(keep * N)) entries (SnapKV, H2O)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..catalog import budget
from .base import LayerBudget


@budget("uniform")
@dataclass(frozen=True)
class UniformBudget(LayerBudget):
    name: ClassVar[str] = "uniform"

    def layer_factors(self, ctx):
        return torch.ones(ctx.num_layers)


@budget("full")
@dataclass(frozen=True)
class FullBudget(LayerBudget):
    """Every layer keeps the whole span (identity)."""

    name: ClassVar[str] = "full"
    keeps_everything: ClassVar[bool] = True

    def layer_factors(self, ctx):
        return torch.ones(ctx.num_layers)

    def allocate(self, ctx, seg, keep):
        return torch.full((ctx.num_layers,), seg.length, dtype=torch.long)
