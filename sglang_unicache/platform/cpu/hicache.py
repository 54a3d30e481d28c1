"""HiCache (``--enable-hierarchical-cache``) on the ``unicache_cpu`` platform.

SGLang's HiCache keeps a host-memory copy of radix-tree nodes and loads them back on a hit. Its
host pool and its transfers are written for a GPU: the host buffer is pinned with
``cudaHostRegister``, the copies are sgl-kernel ops, and the host pool reserves 10 GiB of RAM for
the system before it sizes itself (``pool_host/base.py``, ``HICACHE_HOST_MEMORY_RESERVE_BYTES``),
more than a 24 GB machine can spare. On this platform the "device" pool is itself host memory,
so the platform replaces exactly those three pieces in each worker (``install``):

- the host buffer is an ordinary tensor (nothing to pin or register);
- the ``direct`` io backend's ``transfer_kv_direct`` is an indexed copy per layer, in torch;
- the reserve is ``SGLANG_UNICACHE_HICACHE_RESERVE_GB`` GiB (default 2).

The controller's streams and events are ``torch.cpu``'s (SGLang picks them when no accelerator
is visible). ``server_args_defaults`` selects the ``direct`` io backend and the ``layer_first``
host layout, the one pair the torch copy implements.

Quantized host copies (UniCache seed §6.3: quantize after token compression; config key
``host_quantization``): when the engine builds HiCache's host pool as ``uint8`` rows
(``engine/host_pool.py``), this platform's copy quantizes on the way to host memory and
dequantizes on the way back. Only this platform's copy can do that (on a GPU the copies are
sgl-kernel ops).
"""

from __future__ import annotations

import logging
import os

import torch

from sglang_unicache.policy.quantize import host_bits, pack_host_rows, unpack_host_rows

logger = logging.getLogger(__name__)

RESERVE_ENV = "SGLANG_UNICACHE_HICACHE_RESERVE_GB"
DEFAULT_RESERVE_GB = 2.0


def reserve_bytes() -> int:
    raw = os.environ.get(RESERVE_ENV, str(DEFAULT_RESERVE_GB))
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value < 0:
        raise ValueError(f"{RESERVE_ENV} must be a number of GiB >= 0, got {raw!r}")
    return int(value * 1024**3)


def transfer_kv_direct(src_layers: list[torch.Tensor], dst_layers: list[torch.Tensor],
                       src_indices: torch.Tensor, dst_indices: torch.Tensor,
                       page_size: int) -> None:
    """sgl-kernel's ``transfer_kv_direct``: token ``src_indices[i]`` of every source layer to
    token ``dst_indices[i]`` of the same destination layer (whole pages, so any page size)."""
    if src_indices.numel() != dst_indices.numel():
        raise ValueError(f"transfer_kv_direct: {src_indices.numel()} source and "
                         f"{dst_indices.numel()} destination indices")
    src = src_indices.to(torch.int64)
    dst = dst_indices.to(torch.int64)
    for src_layer, dst_layer in zip(src_layers, dst_layers, strict=True):
        rows = src_layer[src]
        if dst_layer.dtype == torch.uint8 and rows.dtype.is_floating_point:  # to a quantized host
            dst_layer[dst] = pack_host_rows(rows, host_bits(rows.shape[-1], dst_layer.shape[-1]))
        elif rows.dtype == torch.uint8 and dst_layer.dtype.is_floating_point:  # and back
            dst_layer[dst] = unpack_host_rows(rows, dst_layer.shape[-1], dst_layer.dtype)
        else:
            dst_layer[dst] = rows.to(dst_layer.dtype)


def _allocate_unpinned(dims: tuple, dtype: torch.dtype, device: str, pin_memory: bool,
                       allocator, registration_granularity_bytes: int | None = None):
    return allocator.allocate(dims, dtype=dtype, device=device)


def install() -> None:
    """Replace the GPU-only pieces of SGLang's HiCache host pool in this process."""
    from sglang.srt.mem_cache.pool_host import base, common, mha

    common.ALLOC_MEMORY_FUNCS["cpu"] = _allocate_unpinned
    mha.transfer_kv_direct = transfer_kv_direct
    base.HICACHE_HOST_MEMORY_RESERVE_BYTES = reserve_bytes()


def server_args_defaults(server_args) -> None:
    if not getattr(server_args, "enable_hierarchical_cache", False):
        return
    if (server_args.hicache_io_backend, server_args.hicache_mem_layout) != ("direct",
                                                                            "layer_first"):
        logger.info("unicache_cpu: HiCache uses the direct io backend and the layer_first host "
                    "layout (the transfers this platform implements)")
    server_args.hicache_io_backend = "direct"
    server_args.hicache_mem_layout = "layer_first"
