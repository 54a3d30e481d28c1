"""Triton kernel for the observation-window column sums (the second pass of ``window_colsum``).

Same semantics as ``reference.window_colsum`` (the oracle): ``out[h, t] = sum_{g, w} rw[h, w] *
exp(q[w, h*G+g] . k[t, h] * scale - lse[h, g, w])`` over visible entries (``t <= q_pos[w]`` and
``col_mask[h, t]``). One program per (KV head, block of ``BLOCK_T`` keys); it loops over the G*W
query rows, so memory stays ``O(BLOCK_T * D)`` per program. The lse pass stays in torch (it is
``[H, G, W]``, tiny). Tested on CPU with ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

Tensor = torch.Tensor


@triton.jit
def _colsum_kernel(
    q_ptr,
    k_ptr,
    lse_ptr,
    rw_ptr,
    pos_ptr,
    mask_ptr,
    out_ptr,
    T,
    W,
    G,
    D,
    scale,
    stride_qw,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_mh,
    stride_rwh,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    h = tl.program_id(0)
    tb = tl.program_id(1)
    offs_t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    t_ok = offs_t < T
    d_ok = offs_d < D
    k = tl.load(
        k_ptr + offs_t[:, None] * stride_kt + h * stride_kh + offs_d[None, :],
        mask=t_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    col = tl.load(mask_ptr + h * stride_mh + offs_t, mask=t_ok, other=0) != 0
    acc = tl.zeros([BLOCK_T], dtype=tl.float32)
    for r in range(0, G * W):
        g = r // W
        w = r % W
        q = tl.load(
            q_ptr + w * stride_qw + (h * G + g) * stride_qh + offs_d, mask=d_ok, other=0.0
        ).to(tl.float32)
        lse = tl.load(lse_ptr + (h * G + g) * W + w)
        rw = tl.load(rw_ptr + h * stride_rwh + w)
        pos = tl.load(pos_ptr + w)
        logits = tl.sum(k * q[None, :], axis=1) * scale
        visible = t_ok & col & (offs_t <= pos)
        p = tl.where(visible, tl.exp(logits - lse), 0.0)
        acc += rw * p
    tl.store(out_ptr + h * T + offs_t, acc, mask=t_ok)


def window_colsum_triton(
    q: Tensor,
    k: Tensor,
    scale: float,
    q_pos: Tensor,
    lse: Tensor,
    col_mask: Tensor | None = None,
    row_weight: Tensor | None = None,
    block_t: int = 64,
) -> Tensor:
    """Launcher with the signature of ``reference.window_colsum`` (minus ``chunk``)."""
    w, hq, d = q.shape
    t, h, d2 = k.shape
    assert d == d2 and hq % h == 0, "q [W, H*G, D] and k [T, H, D] must agree"
    assert lse.shape == (h, hq // h, w), "lse must be [H, G, W]"
    assert q.stride(-1) == 1 and k.stride(-1) == 1, "head_dim must be contiguous"
    g = hq // h
    dev = q.device
    rw = torch.ones(w, device=dev) if row_weight is None else row_weight.float()
    rw = rw.expand(h, w).contiguous() if rw.dim() == 1 else rw.contiguous()
    cm = torch.ones(t, dtype=torch.bool, device=dev) if col_mask is None else col_mask
    cm = cm.expand(h, t).to(torch.int8).contiguous()
    # a row with no visible key has lse -inf: +inf makes all its probabilities exp(-inf) = 0
    lse = torch.where(torch.isfinite(lse), lse.float(), torch.full_like(lse.float(), float("inf")))
    out = torch.empty(h, t, device=dev, dtype=torch.float32)
    grid = (h, triton.cdiv(t, block_t))
    _colsum_kernel[grid](
        q,
        k,
        lse.contiguous(),
        rw,
        q_pos.to(torch.int64).contiguous(),
        cm,
        out,
        t,
        w,
        g,
        d,
        float(scale),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cm.stride(0),
        rw.stride(0),
        BLOCK_T=block_t,
        BLOCK_D=triton.next_power_of_2(d),
    )
    return out
