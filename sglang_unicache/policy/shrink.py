"""Re-compression of an already compressed span to a smaller budget (ours).

A cached compressed span holds K entries per layer and KV head, each with the selection priority
it was chosen with (``LayerPlan.priority``: protected entries rank above all others, see
``compressor.selection_key``). Under memory pressure the radix cache shrinks the span instead of
evicting it: every (layer, head) keeps its top-K' entries by that priority, so alignment-protected
entries (seed §5.3) survive as long as the budget can hold them. The source tokens of dropped
entries are gone, so nothing is merged again: a shrink only evicts. How many entries a
re-compression keeps is the keep ratio's owner's (``keep.KeepRatio.shrunk``).

    keep = shrink_order(priority, k_new)      # [L, H, K'] indices into the K entries
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["shrink_order"]


def shrink_order(priority: Tensor, k: int) -> Tensor:
    """``[..., K]`` priorities -> ``[..., k]`` int64 indices of the entries kept, ascending (the
    kept entries stay in their original order)."""
    if not 1 <= k <= priority.shape[-1]:
        raise ValueError(f"cannot keep {k} of {priority.shape[-1]} entries")
    return torch.topk(priority.float(), k, dim=-1).indices.sort(dim=-1).values
