"""PyramidKV layer budget (Cai et al., 2024, "PyramidKV: Dynamic KV Cache Compression based on
Pyramidal Information Funneling"): budgets decrease arithmetically from the first to the last layer;
the last layer gets ``average / beta`` (beta = 20 in the paper) and the first ``2*average - last``,
so the mean is the requested budget.

Per layer l of L, with ``avg`` the requested budget (the original code, Zefan-Cai/KVCache-Factory
``pyramidkv_utils.py``): ``min = avg / beta``, ``max = 2 * avg - min``, ``steps = (max - min) /
(L - 1)``, ``K_l = max - l * steps``. Our budgets are those factors apportioned to integers
summing to ``L * avg`` (``apportion``), so each is within one token of the formula
(``tests/policy/test_kvpress_peer.py`` checks it, and kvpress's transcription, per layer).

Departures: the original code floors ``min`` and ``steps`` (integer division), so its budgets do
not average to the requested one (32 layers, avg 100: the last layer keeps 9, not 5, and the
layers 3264 entries, not 3200); like kvpress we use the real-valued formula, whose mean is
exactly the requested budget. PyramidKV also always keeps the observation window; here the window
is text and text is never compressed, so that part is implicit. The AirCache seed's ablation found
this pyramid *hurts* LVLMs; it is here as a baseline.
"""

from __future__ import annotations

import torch

from sglang_unicache.policy.budgets.base import LayerBudget
from sglang_unicache.policy.catalog import budget


def pyramid_factors(num_layers: int, beta: float) -> torch.Tensor:
    """``[L]`` factors with mean 1: from ``2 - 1/beta`` (layer 0) down to ``1/beta`` (last)."""
    if num_layers == 1:
        return torch.ones(1)
    top = 1.0 / beta
    bottom = 2.0 - top
    return torch.linspace(bottom, top, num_layers)


@budget("pyramid", prefix="pyramid_")
class PyramidBudget(LayerBudget):
    """beta: the last layer keeps ``average / beta`` (paper: 20)."""

    beta: float = 20.0

    def layer_factors(self, ctx):
        return pyramid_factors(ctx.num_layers, self.beta)
