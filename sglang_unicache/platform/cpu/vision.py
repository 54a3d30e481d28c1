"""The vision tower's attention on the ``unicache_cpu`` platform: one image at a time.

With no Triton or FlashAttention kernel, SGLang's vision towers use ``VisionSdpaAttention``
(``layers/attention/vision.py``). With ``flatten_batch`` (Qwen2-VL and its kin), every image of a
prefill batch is one sequence of ``s`` patches, and a boolean ``[1, s, s]`` mask keeps each patch
inside its own image (segments of ``cu_seqlens``). That is exact, but it costs the whole square:
a batch of ``k`` images of ``n`` patches pays ``(k n)^2`` instead of ``k n^2``, and each mask is
kept in an ``lru_cache`` of 128 (256 MiB for four 1,024-token images: 16,384 patches). On the
2-core CPU, four such images in one call took 4.5 s per layer against 0.1 s one image at a
time, and one image alone 0.33 s against 0.03 s (``benchmarks/bench_vision_attention.py``,
``BENCHMARKS.md``, "CPU vision attention"). Which images share a call depends on which requests
arrive together, so a serving run's encoder time would depend on its timing.

``install`` replaces ``VisionSdpaAttention.forward`` with ``forward_by_segment``: where the mask
would be the block-diagonal one of ``cu_seqlens`` and its segments cover the sequence, it runs
SDPA on each segment with no mask, the same attention. Any other call (an explicit mask, the
single-precision softmax path, ``bsz > 1``) goes to SGLang's own ``forward``.
"""

from __future__ import annotations

from itertools import pairwise

import torch
import torch.nn.functional as F

_ORIGINAL = "_unicache_original_forward"


def segments(cu_seqlens: torch.Tensor | None, total: int) -> list[tuple[int, int]] | None:
    """``[(start, end), ...]`` of ``cu_seqlens``, or None unless they tile ``[0, total)``."""
    if cu_seqlens is None:
        return None
    bounds = [int(b) for b in cu_seqlens.tolist()]
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != total:
        return None
    if any(end < start for start, end in pairwise(bounds)):
        return None
    return [(start, end) for start, end in pairwise(bounds) if end > start]


def sglang_forward(cls):
    """SGLang's own ``forward`` of ``cls``: the one ``install`` kept aside, else the class's."""
    return getattr(cls, _ORIGINAL, cls.forward)


def forward_by_segment(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bsz: int,
                       cu_seqlens: torch.Tensor | None = None,
                       attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """``VisionSdpaAttention.forward``, one ``cu_seqlens`` segment (image or frame) at a time."""
    spans = None
    if (self.flatten_batch and bsz == 1 and attention_mask is None and q.dim() == 3
            and not self.softmax_in_single_precision and self.num_heads == self.num_kv_heads):
        spans = segments(cu_seqlens, q.shape[0])
    if spans is None:
        return sglang_forward(type(self))(self, q, k, v, bsz, cu_seqlens=cu_seqlens,
                                          attention_mask=attention_mask, **kwargs)
    heads, dim = self.num_heads, self.head_size
    out = q.new_empty(q.shape[0], heads, dim)
    for start, end in spans:
        # [n, h, d] -> [1, h, n, d]
        qs, ks, vs = (x[start:end].reshape(1, end - start, heads, dim).transpose(1, 2)
                      for x in (q, k, v))
        attended = F.scaled_dot_product_attention(qs, ks, vs, dropout_p=self.dropout,
                                                  is_causal=False, scale=self.scale)
        out[start:end] = attended.transpose(1, 2).reshape(end - start, heads, dim)
    return out


def install() -> None:
    """Route ``VisionSdpaAttention.forward`` through ``forward_by_segment`` (idempotent)."""
    from sglang.srt.layers.attention.vision import VisionSdpaAttention

    if hasattr(VisionSdpaAttention, _ORIGINAL):
        return
    setattr(VisionSdpaAttention, _ORIGINAL, VisionSdpaAttention.forward)
    VisionSdpaAttention.forward = forward_by_segment
