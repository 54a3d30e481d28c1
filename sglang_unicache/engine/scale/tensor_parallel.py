"""``--tp-size N``: every attention-TP rank compresses the same request into the same shape.

Each rank holds ``num_kv_heads / N`` KV heads. The policy layer agrees on everything that decides
the shape through ``ranks.HeadShards`` (head averages summed over the ranks), so the ranks plan
the same keep ratio, K per span and layer and self-check verdict, and name their spans alike;
the per-head selection stays each rank's own. The collective is SGLang's attention-TP CPU (gloo)
group, the one the scheduler itself uses to agree on requests.

Failures are agreed too, so a rank that raises (an OOM mid-plan) never pairs its collectives
with different ones on the other ranks. Every collective of a compression step opens with a
one-number status round; a rank that failed sends its failure in one such round
(``settle(failed=True)``) and stops, and the others, at their next round, raise ``PeerFailed``
and stop there too. All ranks so leave a step after the same round with the same verdict
(``settle``), whatever failed where.

``agree`` is the check that this holds: after every compression attempt each rank contributes a
fingerprint (the outcome, the keep ratio, the slots each span kept, the free slots left) and
a difference is counted (``rank_disagreements``) and reported by ``check_integrity``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sglang_unicache.policy.ranks import ONE_RANK, HeadShards


class PeerFailed(RuntimeError):
    """Another tensor-parallel rank failed the step this one is in: stop it, call no more
    collectives for it."""


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
        y = x.detach().to("cpu", torch.float64, copy=True)  # before the round: nothing between
        self._round(failed=False)
        dist.all_reduce(y, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX,
                        group=self.group)
        return y.to(x.device, x.dtype)

    def _round(self, failed: bool) -> None:
        """The status round that opens every collective; raises ``PeerFailed`` on a rank that
        did not fail when another did."""
        flag = torch.tensor([1.0 if failed else 0.0], dtype=torch.float64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if flag.item() > 0 and not failed:
            raise PeerFailed("another tensor-parallel rank failed this compression")

    def settle(self, failed: bool) -> bool:
        """End a compression step: True when no rank failed it. Every rank calls it once per
        step unless the step raised ``PeerFailed`` (that rank already knows: the verdict is
        False, and it must not call this)."""
        if self.size == 1:
            return not failed
        try:
            self._round(failed)
        except PeerFailed:
            return False
        return not failed

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
