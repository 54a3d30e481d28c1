"""Per-head int8 / int4 quantization of compressed K/V (UniCache seed §6.3).

Symmetric, one fp32 scale per KV head = max |x| over the head's entries / qmax (qmax 127 for int8,
7 for int4), as the seed prescribes (per-head; not per-tensor, which lost precision on heads with a
small dynamic range, seed §9). Applied after token compression (seed §6.3: quantizing first would
perturb the importance scores). Error bound: |x - dequant(quant(x))| <= scale / 2 per element.

SGLang's KV pool holds one dtype for every slot, so the engine would store these payloads in a
separate tier; the executor always also returns dequantized tensors in the input dtype.
"""

from __future__ import annotations

import torch

from sglang_unicache.policy.plans import QuantizedTensor

Tensor = torch.Tensor
QMAX = {8: 127, 4: 7}


def bits_of(mode: str) -> int:
    return {"int8": 8, "int4": 4}[mode]


def quantize(x: Tensor, bits: int) -> QuantizedTensor:
    """Quantize ``x [K, H, D]`` per head."""
    k, h, d = x.shape
    xh = x.float().transpose(0, 1).reshape(h, k * d)
    qmax = QMAX[bits]
    scale = (xh.abs().amax(dim=1) / qmax).clamp_min(1e-12)
    q = torch.round(xh / scale.unsqueeze(1)).clamp(-qmax - (bits == 4), qmax)
    if bits == 8:
        data = q.to(torch.int8)
    else:
        codes = (q + 8).to(torch.uint8)
        if codes.shape[1] % 2:
            codes = torch.cat([codes, torch.full_like(codes[:, :1], 8)], dim=1)
        data = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return QuantizedTensor(data=data, scale=scale, bits=bits, shape=(k, h, d))


def dequantize(qt: QuantizedTensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Inverse of ``quantize``: ``[K, H, D]`` in ``dtype``."""
    k, h, d = qt.shape
    if qt.bits == 8:
        q = qt.data.float()
    else:
        lo = (qt.data & 0xF).float() - 8
        hi = (qt.data >> 4).float() - 8
        q = torch.stack([lo, hi], dim=-1).reshape(h, -1)[:, : k * d]
    x = q * qt.scale.unsqueeze(1)
    return x.reshape(h, k, d).transpose(0, 1).to(dtype)


def quantized_nbytes(k: int, h: int, d: int, bits: int) -> int:
    """Bytes of ``quantize`` output for a ``[k, h, d]`` tensor (payload + fp32 scales)."""
    per_head = k * d if bits == 8 else (k * d + 1) // 2
    return h * per_head + 4 * h


# -- HiCache host copies (``host_quantization``) ------------------------------------------------
# The host tier stores KV slot by slot, so its copies are quantized per (slot, KV head): one
# bfloat16 scale (2 bytes, kept in the row) per head_dim values, finer than the per-head scale
# above, which spans a whole compressed image.
SCALE_BYTES = 2


def host_row_bytes(head_dim: int, bits: int) -> int:
    """Bytes of one (slot, head) row of a quantized host copy: payload and its scale."""
    if bits == 4 and head_dim % 2:
        raise ValueError(f"int4 host copies need an even head_dim, got {head_dim}")
    return (head_dim if bits == 8 else head_dim // 2) + SCALE_BYTES


def host_bits(head_dim: int, row_bytes: int) -> int:
    """The bits of a quantized host row ``row_bytes`` wide (``host_row_bytes``'s inverse)."""
    for bits in (8, 4):
        if row_bytes == host_row_bytes(head_dim, bits):
            return bits
    raise ValueError(f"a {row_bytes}-byte host row holds no quantized head of {head_dim} values")


def pack_host_rows(x: Tensor, bits: int) -> Tensor:
    """``x [T, H, D]`` (any float dtype) as ``[T, H, host_row_bytes(D, bits)]`` uint8 rows:
    symmetric codes with scale max |x| / qmax per (slot, head), the scale's bfloat16 bytes last."""
    x = x.float()
    qmax = QMAX[bits]
    # Rounded up to bfloat16 (its rounding is within 2**-8), so no code clamps at qmax.
    scale = (x.abs().amax(dim=-1, keepdim=True) / qmax * (1 + 2**-7)).clamp_min(1e-12)
    scale = scale.to(torch.bfloat16)
    q = torch.round(x / scale.float()).clamp(-qmax - (bits == 4), qmax)
    if bits == 8:
        payload = q.to(torch.int8).view(torch.uint8)
    else:
        codes = (q + 8).to(torch.uint8)
        payload = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return torch.cat([payload, scale.view(torch.uint8)], dim=-1)


def unpack_host_rows(rows: Tensor, head_dim: int, dtype: torch.dtype) -> Tensor:
    """Inverse of ``pack_host_rows``: ``[T, H, head_dim]`` in ``dtype``."""
    bits = host_bits(head_dim, rows.shape[-1])
    payload, scale = rows[..., :-SCALE_BYTES], rows[..., -SCALE_BYTES:].contiguous()
    scale = scale.view(torch.bfloat16).float()
    if bits == 8:
        q = payload.contiguous().view(torch.int8).float()
    else:
        lo = (payload & 0xF).float() - 8
        hi = (payload >> 4).float() - 8
        q = torch.stack([lo, hi], dim=-1).reshape(*payload.shape[:-1], head_dim)
    return (q * scale).to(dtype)
