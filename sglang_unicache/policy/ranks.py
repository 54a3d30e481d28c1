"""Tensor-parallel ranks: the head-averaged statistics of a plan, agreed by every rank.

Under tensor parallelism each rank holds ``num_kv_heads / tp`` KV heads of every layer and their
query groups. What is per head stays local: scores, the per-head top-K, merge assignments (a KV
head and its queries live on one rank). What decides the plan's *shape* must be the same on every
rank, or the ranks' radix trees, rows and allocators diverge: the self-check verdict and its
escalations, K per span and layer (AirCache's budgets), the alignment tokens and the dynamic
rate. Those are head averages (or maxima), so the parts read them through ``HeadShards``:
``mean`` sums the local heads' values and all-reduces the sums, so TP = 2 computes the numbers
TP = 1 does (up to the order of a floating-point sum) and every rank gets the same ones.

The engine passes ``all_reduce(tensor, op)`` (``op`` "sum" or "max"; every rank must get the same
result); the policy layer imports nothing from SGLang. Every rank runs the same plan code on the
same request, so the collectives come in the same order on each.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Tensor = torch.Tensor
AllReduce = Callable[[Tensor, str], Tensor]


@dataclass(frozen=True)
class HeadShards:
    """The KV heads of one layer across ranks: ``total_heads`` over all ranks and the collective
    that combines the ranks' partial values (None: one rank holds every head)."""

    total_heads: int | None = None
    all_reduce: AllReduce | None = None
    first_head: int = 0  # this rank's first head among all ranks' (a seeded draw slices by it)

    def __post_init__(self) -> None:
        if (self.total_heads is None) != (self.all_reduce is None):
            raise ValueError("HeadShards needs both total_heads and all_reduce, or neither")

    @property
    def sharded(self) -> bool:
        return self.all_reduce is not None

    def sum(self, x: Tensor) -> Tensor:
        """``x`` summed over the ranks."""
        return x if self.all_reduce is None else self.all_reduce(x, "sum")

    def max(self, x: Tensor) -> Tensor:
        """The elementwise maximum of ``x`` over the ranks."""
        return x if self.all_reduce is None else self.all_reduce(x, "max")

    def heads(self, local: int) -> tuple[int, int]:
        """(every rank's heads, this rank's first) for a layer with ``local`` heads here."""
        return (local, 0) if self.total_heads is None else (self.total_heads, self.first_head)

    def mean(self, x: Tensor) -> Tensor:
        """``x`` ``[H_local, ...]`` averaged over every rank's heads: ``[...]``."""
        if self.all_reduce is None:
            return x.mean(0)
        return self.sum(x.sum(0)) / self.total_heads


ONE_RANK = HeadShards()
