"""Contract of a reducer (the "what happens to the tokens not kept" axis).

A reducer receives, for one span and one layer, the selected entries ``kept [H, K]`` (ascending,
span-relative) and the span's scores ``[H, N]`` and returns ``(assign [H, N] int32, weight [H, N]
fp32)`` as documented on ``LayerPlan``: ``assign[h, kept[h, j]] == j``, evicted tokens -1, weights
of each entry summing to 1. It must not change ``kept`` and must not modify any input tensor.
A reducer is a frozen dataclass whose fields are its parameters (``catalog.from_config``).
Quantization (``../quantize.py``) is not a reducer: it applies to the executed entries (seed §6.3:
token compression first, then quantization).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from sglang_unicache.policy.context import PlanContext
    from sglang_unicache.policy.inputs import ImageSpan

Tensor = torch.Tensor


class Reducer(Protocol):
    name: str
    merges: bool  # may an entry hold more than one source token?

    def reduce(
        self, ctx: PlanContext, layer: int, seg: ImageSpan, kept: Tensor, scores: Tensor
    ) -> tuple[Tensor, Tensor]: ...


def keep_only(kept: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """The assignment of plain eviction: kept tokens map to their own entry, all others to -1
    (kept ``[..., H, K]``, layers stacked in front give each layer's)."""
    k = kept.shape[-1]
    assign = torch.full((*kept.shape[:-1], n), -1, dtype=torch.int32, device=kept.device)
    entries = torch.arange(k, dtype=torch.int32, device=kept.device).expand_as(kept)
    assign.scatter_(-1, kept, entries)
    return assign, (assign >= 0).float()
