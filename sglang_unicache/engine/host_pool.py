"""Quantized host copies for HiCache (UniCache seed §6.3: quantize after token compression;
config key ``host_quantization``).

``quantize_host_copies(bits)`` makes HiCache build its host pool as ``uint8`` rows of
``quantize.host_row_bytes`` bytes per (slot, KV head): int8 or int4 codes with their scale. The
copies between the pools quantize on the way to host memory and dequantize on the way back; only
the ``unicache_cpu`` platform's copy does that (``platform/cpu/hicache.py``), so support refuses
``host_quantization`` elsewhere.
"""

from __future__ import annotations

import torch

from sglang_unicache.policy.quantize import host_row_bytes

_quantized_pools: dict[int, type] = {}


def quantized_host_pool(bits: int) -> type:
    """SGLang's MHA host pool, its buffer ``uint8`` rows of int8 or int4 codes and a scale."""
    if bits in _quantized_pools:
        return _quantized_pools[bits]
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    class QuantizedHostPool(MHATokenToKVPoolHost):
        def get_size_per_token(self):
            return 2 * self.layer_num * self.head_num * host_row_bytes(self.head_dim, bits)

        def init_kv_buffer(self):
            if self.layout != "layer_first":
                raise ValueError(f"quantized host copies need the layer_first layout, got "
                                 f"{self.layout}")
            dims = (2, self.layer_num, self.size, self.head_num,
                    host_row_bytes(self.head_dim, bits))
            self.token_stride_size = self.head_num * host_row_bytes(self.head_dim, bits)
            self.layout_dim = self.token_stride_size * self.layer_num
            return self.allocator.allocate(dims, dtype=torch.uint8, device=self.device)

    QuantizedHostPool.__name__ = f"Int{bits}HostPool"
    _quantized_pools[bits] = QuantizedHostPool
    return QuantizedHostPool


def quantize_host_copies(bits: int) -> None:
    """Build HiCache's host pool from now on in this process as ``quantized_host_pool(bits)``."""
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as assembler

    pool = quantized_host_pool(bits)
    assembler.get_mha_host_pool_cls = lambda buffer_info: pool
