"""Per-head int8 / int4 quantization of compressed K/V (UniCache seed §6.3).

Symmetric, one fp32 scale per KV head = max |x| over the head's entries / qmax (qmax 127 for int8,
7 for int4), as the seed prescribes (per-head; not per-tensor, which lost precision on heads with a
small dynamic range, seed §9). Applied after token compression (seed §6.3: quantizing first would
perturb the importance scores). Error bound: |x - dequant(quant(x))| <= scale / 2 per element.

SGLang's pool has one dtype (DESIGN §5), so the engine would store these payloads in a separate
tier; the executor always also returns dequantized tensors in the input dtype.
"""

from __future__ import annotations

import torch

from .plans import QuantizedTensor

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
