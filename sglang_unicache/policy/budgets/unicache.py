"""UniCache layer rates on a cosine curve (UniCache seed §4.3, §8.1).

Compression rate of layer l (0-based, L layers):

    rate_l = deep + (shallow - deep) * (1 + cos(pi * l / (L - 1))) / 2

from ``shallow_rate`` 0.75 at the first layer to ``deep_rate`` 0.45 at the last, smooth (the seed
replaced hard steps and linear interpolation by a cosine curve, §4.3, §9). With L = 3 this is
exactly the seed's shallow/middle/deep 0.75/0.60/0.45.

The curve gives the *profile*; the requested keep ratio gives the *level*: layer factors are the
kept fractions ``1 - rate_l`` divided by their mean, so the average kept fraction over layers equals
``keep_ratio`` (departure: the seed uses the curve's own mean 0.6 as the total rate).
"""

from __future__ import annotations

import math

import torch

from sglang_unicache.policy.budgets.base import LayerBudget
from sglang_unicache.policy.catalog import budget


def cosine_rates(num_layers: int, shallow: float, deep: float) -> torch.Tensor:
    """``[L]`` float64 compression rates, shallow -> deep along a half cosine."""
    if num_layers == 1:
        return torch.tensor([(shallow + deep) / 2], dtype=torch.float64)
    lin = torch.arange(num_layers, dtype=torch.float64) / (num_layers - 1)
    return deep + (shallow - deep) * (1 + torch.cos(math.pi * lin)) / 2


@budget("unicache")
class UniCacheBudget(LayerBudget):
    """shallow_rate / deep_rate: compression rate of the first / last layer (seed: 0.75 / 0.45)."""

    shallow_rate: float = 0.75
    deep_rate: float = 0.45

    def layer_factors(self, ctx):
        keep = 1 - cosine_rates(ctx.num_layers, self.shallow_rate, self.deep_rate)
        return keep / keep.mean()
