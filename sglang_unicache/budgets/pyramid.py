"""PyramidKV layer budget (Cai et al., 2024, "PyramidKV: Dynamic KV Cache Compression based on
Pyramidal Information Funneling"): budgets decrease arithmetically from the first to the last layer;
the last layer gets ``average / beta`` (beta = 20 in the paper) and the first ``2*average - last``,
so the mean is the requested budget.

Departure: PyramidKV also always keeps the observation window; here the window is text and text is
never compressed, so that part is implicit. The AirCache seed's ablation found this pyramid
*hurts* LVLMs; it is here as a baseline.
"""

from __future__ import annotations

import torch

from ..catalog import budget
from .base import LayerBudget


def pyramid_factors(num_layers: int, beta: float) -> torch.Tensor:
    """``[L]`` factors with mean 1: from ``2 - 1/beta`` (layer 0) down to ``1/beta`` (last)."""
    if num_layers == 1:
        return torch.ones(1)
    top = 1.0 / beta
    bottom = 2.0 - top
    return torch.linspace(bottom, top, num_layers)


@budget("pyramid", lambda c: PyramidBudget(c.pyramid_beta))
class PyramidBudget(LayerBudget):
    name = "pyramid"

    def __init__(self, beta: float = 20.0) -> None:
        self.beta = beta

    def layer_factors(self, ctx):
        return pyramid_factors(ctx.num_layers, self.beta)
