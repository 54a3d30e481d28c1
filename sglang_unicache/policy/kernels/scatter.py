"""Scatter compressed K/V rows into KV-pool slots: a Triton kernel and its torch reference.

``write_compressed`` writes, for every layer, ``keys[l][j]`` (``[H, D]``) into
``k_buffers[l][slots[j]]`` and the same for values. CUDA tensors take the Triton kernel
(``scatter_rows_triton``); other devices take ``scatter_rows_reference``, the oracle the kernel is
tested against under ``TRITON_INTERPRET=1``. Both cast to the pool's dtype with torch. One-byte
pools (``--kv-cache-dtype fp8_e4m3`` / ``fp8_e5m2``) are copied as bytes: CPU torch has no
indexed copy for float8, and a copy kernel needs none.
"""

from __future__ import annotations

import torch


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A float8 tensor seen as uint8 (same storage); any other tensor as it is."""
    return t.view(torch.uint8) if t.is_floating_point() and t.element_size() == 1 else t


def scatter_rows_reference(dst: torch.Tensor, slots: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[slots[j]] = src[j]`` for ``dst [S, H, D]``, ``slots [K]`` int64, ``src [K, H, D]``."""
    as_bytes(dst).index_copy_(0, slots, as_bytes(src.to(dst.dtype)))


def _check(dst: torch.Tensor, slots: torch.Tensor, src: torch.Tensor) -> None:
    assert dst.dim() == 3 and src.dim() == 3 and dst.shape[1:] == src.shape[1:], (
        f"dst {tuple(dst.shape)} and src {tuple(src.shape)} must be [*, H, D] alike"
    )
    assert slots.dim() == 1 and slots.shape[0] == src.shape[0], "one slot per source row"
    assert dst.is_contiguous() and src.is_contiguous(), "contiguous rows expected"


try:
    import triton
    import triton.language as tl

    @triton.jit
    def _scatter_rows_kernel(dst_ptr, src_ptr, slots_ptr, row_elems, BLOCK: tl.constexpr):
        j = tl.program_id(0)
        block = tl.program_id(1)
        slot = tl.load(slots_ptr + j).to(tl.int64)
        offs = block * BLOCK + tl.arange(0, BLOCK)
        mask = offs < row_elems
        vals = tl.load(src_ptr + j.to(tl.int64) * row_elems + offs, mask=mask)
        tl.store(dst_ptr + slot * row_elems + offs, vals, mask=mask)

    def scatter_rows_triton(dst: torch.Tensor, slots: torch.Tensor, src: torch.Tensor) -> None:
        """Triton version of ``scatter_rows_reference`` (same semantics)."""
        # Cast with torch, as the reference does, so both round the same way; the kernel copies.
        src, dst = as_bytes(src.to(dst.dtype).contiguous()), as_bytes(dst)
        _check(dst, slots, src)
        if slots.numel() == 0:
            return
        row_elems = dst.shape[1] * dst.shape[2]
        block = min(1024, triton.next_power_of_2(row_elems))
        grid = (slots.shape[0], triton.cdiv(row_elems, block))
        _scatter_rows_kernel[grid](dst, src, slots, row_elems, BLOCK=block)

except ImportError:  # pragma: no cover - triton is a dependency of sglang
    scatter_rows_triton = None


def write_compressed(k_buffers, v_buffers, slots: torch.Tensor, keys, values) -> None:
    """Write per-layer compressed K/V (``[K, H, D]`` each) into ``slots`` of every layer."""
    slots = slots.to(torch.int64)
    for dst_k, dst_v, k, v in zip(k_buffers, v_buffers, keys, values, strict=True):
        for dst, src in ((dst_k, k), (dst_v, v)):
            src = src.to(device=dst.device).contiguous()
            if dst.is_cuda and scatter_rows_triton is not None:
                scatter_rows_triton(dst, slots.to(dst.device), src)
            else:
                scatter_rows_reference(dst, slots.to(dst.device), src)
