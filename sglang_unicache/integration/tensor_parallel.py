"""``--tp-size N``: every attention-TP rank compresses the same request into the same shape.

Each rank holds ``num_kv_heads / N`` KV heads. The policy layer agrees on everything that decides
the shape through ``ranks.HeadShards`` (head averages summed over the ranks), so the ranks plan
the same keep ratio, K per span and layer and self-check verdict, and name their spans alike;
the per-head selection stays each rank's own. The collective is SGLang's attention-TP CPU (gloo)
group, the one the scheduler itself uses to agree on requests.

``agree`` is the check that this holds: after every compression attempt each rank contributes a
fingerprint (the outcome, the keep ratio, the slots each span kept, the free slots left) and
a difference is counted (``rank_disagreements``) and reported by ``check_integrity``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sglang_unicache.ranks import ONE_RANK, HeadShards


@dataclass(frozen=True)
class TensorParallel:
    """This scheduler's place in its attention-TP group (``size`` 1: no collective at all)."""

    size: int = 1
    rank: int = 0
    group: Any = None  # the gloo process group

    @classmethod
    def of(cls, scheduler: Any) -> TensorParallel:
        group = scheduler.attn_tp_group
        if group.world_size == 1:
            return cls()
        return cls(group.world_size, group.rank_in_group, group.cpu_group)

    def all_reduce(self, x: torch.Tensor, op: str) -> torch.Tensor:
        y = x.detach().to("cpu", torch.float64, copy=True)
        dist.all_reduce(y, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX,
                        group=self.group)
        return y.to(x.device, x.dtype)

    def shards(self, local_heads: int) -> HeadShards:
        if self.size == 1:
            return ONE_RANK
        return HeadShards(local_heads * self.size, self.all_reduce, self.rank * local_heads)

    def agree(self, fingerprint: list[float]) -> bool:
        """True when every rank passed the same fingerprint (always on one rank)."""
        if self.size == 1:
            return True
        x = torch.tensor(fingerprint, dtype=torch.float64)
        both = self.all_reduce(torch.cat([x, -x]), "max")
        return bool(torch.equal(both[: x.numel()], -both[x.numel():]))
