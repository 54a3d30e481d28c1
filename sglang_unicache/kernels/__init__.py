"""Kernels of the policy hot paths.

- ``reference.py``    torch versions: the CPU path and the test oracle (window lse / column sums,
                      per-head gather + weighted merge)
- ``window_score.py`` Triton kernel of the window column sums (imported lazily, CUDA only)

``window_colsum`` dispatches: CUDA tensors with Triton installed -> the kernel, else the reference.
"""

from __future__ import annotations

from .reference import merge_gather, window_lse
from .reference import window_colsum as _window_colsum_ref

__all__ = ["merge_gather", "window_colsum", "window_lse"]


def window_colsum(q, k, scale, q_pos, lse, col_mask=None, row_weight=None, chunk=8192):
    if q.is_cuda:
        try:
            from .window_score import window_colsum_triton
        except ImportError:  # pragma: no cover - triton missing
            pass
        else:
            return window_colsum_triton(q, k, scale, q_pos, lse, col_mask, row_weight)
    return _window_colsum_ref(q, k, scale, q_pos, lse, col_mask, row_weight, chunk)
