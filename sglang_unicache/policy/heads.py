"""Head merging (UniCache seed §3): cluster a layer's KV heads by cosine similarity, average each
cluster with weights, and keep a head-index map so every original head knows its cluster.

Order (seed §3.2): heads are merged *before* token scoring, so token importance is computed on the
merged representation (``PlanContext`` merges before any signal); the compressor therefore scores
and selects tokens per cluster, and the executor (``executor.py``) merges the stored K/V.

Honesty note (``docs/policy.md``, "Honest memory accounting"): SGLang's ``MHATokenToKVPool`` stores
every KV head in every slot, so replacing heads by their cluster mean saves no pool memory. The
saving (one copy per cluster) is reported separately as ``ByteReport.head_merged`` and needs its own
storage / attention path. It is off in the engine path by default (``UniCacheConfig.head_merge``).

Departure: clustering is single-linkage (the transitive closure of "cosine >= threshold"), computed
with boolean matrix products instead of a Python loop over heads; the seed does not name the
clustering algorithm. Weights: a head's summed cosine to its cluster members (central heads weigh
more), normalised within the cluster; the seed only says "weighted average".
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def head_similarity(keys: Tensor, values: Tensor) -> Tensor:
    """``[H, H]`` cosine similarity of heads, each head flattened over tokens as [K | V]."""
    t, h, d = keys.shape
    flat = torch.cat([keys.float(), values.float()], dim=-1).permute(1, 0, 2).reshape(h, -1)
    flat = F.normalize(flat, dim=-1)
    return flat @ flat.T


def plan_head_merge(keys: Tensor, values: Tensor, threshold: float) -> tuple[Tensor, Tensor]:
    """Cluster heads of one layer; returns ``(head_map [H] int64, head_weight [H] fp32)``.

    ``head_map[h]`` is the smallest head index of h's cluster; weights sum to 1 in each cluster.
    """
    sim = head_similarity(keys, values)
    h = sim.shape[0]
    reach = sim >= threshold
    reach |= torch.eye(h, dtype=torch.bool, device=sim.device)
    for _ in range(max(1, math.ceil(math.log2(max(h, 2))))):
        reach = (reach.float() @ reach.float()) > 0
    head_map = reach.int().argmax(dim=1)  # first True = smallest member index
    centrality = (sim.clamp_min(0) * reach.float()).sum(dim=1)
    total = torch.zeros(h, device=sim.device).index_add_(0, head_map, centrality)
    return head_map, centrality / total[head_map]


def apply_head_merge(x: Tensor, head_map: Tensor, head_weight: Tensor) -> Tensor:
    """Replace each head of ``x [T, H, D]`` by its cluster's weighted mean (same dtype).
    A singleton cluster (weight 1) is returned unchanged."""
    merged = torch.zeros(x.shape[1], x.shape[0], x.shape[2], device=x.device)  # [H, T, D]
    merged.index_put_((head_map,), (x.float() * head_weight.view(1, -1, 1)).transpose(0, 1), True)
    out = merged[head_map].transpose(0, 1).to(x.dtype)
    single = (torch.bincount(head_map, minlength=x.shape[1])[head_map] == 1).view(1, -1, 1)
    return torch.where(single, x, out)


def num_clusters(head_map: Tensor) -> int:
    return int(torch.unique(head_map).numel())
