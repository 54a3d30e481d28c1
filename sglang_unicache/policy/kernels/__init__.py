"""Kernels of the policy hot paths.

- ``reference.py``    torch versions: the CPU path and the test oracle (window lse / column sums,
                      per-head gather + weighted merge)
- ``window_score.py`` Triton kernel of the window column sums (imported lazily, CUDA only)

``window_colsum`` dispatches: CUDA tensors with Triton installed -> the kernel, else the reference.
``warm_up`` runs every kernel once on tiny tensors of the serving shapes, so the JIT compiles at
startup rather than inside the first request that compresses.
"""

from __future__ import annotations

import torch

from sglang_unicache.policy.kernels.reference import merge_gather, window_lse
from sglang_unicache.policy.kernels.reference import window_colsum as _window_colsum_ref

__all__ = ["merge_gather", "warm_up", "window_colsum", "window_lse"]


def window_colsum(q, k, scale, q_pos, lse, col_mask=None, row_weight=None, chunk=8192):
    if q.is_cuda:
        try:
            from sglang_unicache.policy.kernels.window_score import window_colsum_triton
        except ImportError:  # pragma: no cover - triton missing
            pass
        else:
            return window_colsum_triton(q, k, scale, q_pos, lse, col_mask, row_weight)
    return _window_colsum_ref(q, k, scale, q_pos, lse, col_mask, row_weight, chunk)


def warm_up(device, kv_heads: int, q_heads: int, head_dim: int, dtype) -> list[str]:
    """Run each kernel that ``device`` dispatches to once, with the pool's head layout and
    dtype; the kernels run (an empty list on a device with none)."""
    from sglang_unicache.policy.kernels.scatter import scatter_rows_triton, write_compressed

    if torch.device(device).type != "cuda":
        return []
    warmed = []
    k = torch.randn(8, kv_heads, head_dim, device=device).to(dtype)
    q = torch.randn(2, q_heads, head_dim, device=device).to(dtype)
    pos = torch.tensor([6, 7], device=device)
    lse = window_lse(q, k, head_dim**-0.5, pos)
    window_colsum(q, k, head_dim**-0.5, pos, lse)
    warmed.append("window_colsum")
    if scatter_rows_triton is not None:
        dst = torch.zeros_like(k)
        write_compressed([dst], [dst.clone()], torch.arange(2, device=device), [k[:2]], [k[:2]])
        warmed.append("scatter_rows")
    torch.cuda.synchronize(device)
    return warmed
