"""The CPU platform's HiCache pieces: the torch ``transfer_kv_direct`` against an indexed copy,
and the configurable host-memory reserve."""

from __future__ import annotations

import pytest
import torch

from sglang_unicache.platform.cpu import hicache


def test_transfer_kv_direct_copies_every_layer_at_the_given_indices():
    torch.manual_seed(0)
    src = [torch.randn(10, 2, 4, dtype=torch.bfloat16) for _ in range(3)]
    dst = [torch.zeros(16, 2, 4, dtype=torch.bfloat16) for _ in range(3)]
    src_at, dst_at = torch.tensor([7, 0, 3]), torch.tensor([2, 15, 9])
    hicache.transfer_kv_direct(src, dst, src_at, dst_at, page_size=1)
    for s, d in zip(src, dst, strict=True):
        expected = torch.zeros_like(d)
        expected[dst_at] = s[src_at]
        assert torch.equal(d, expected)


def test_transfer_kv_direct_refuses_mismatched_indices():
    layer = [torch.zeros(4, 1, 2)]
    with pytest.raises(ValueError, match="2 source and 1 destination"):
        hicache.transfer_kv_direct(layer, layer, torch.tensor([0, 1]), torch.tensor([2]), 1)


def test_reserve_is_configurable(monkeypatch):
    monkeypatch.delenv(hicache.RESERVE_ENV, raising=False)
    assert hicache.reserve_bytes() == 2 * 1024**3
    monkeypatch.setenv(hicache.RESERVE_ENV, "0.5")
    assert hicache.reserve_bytes() == 1024**3 // 2
    monkeypatch.setenv(hicache.RESERVE_ENV, "-1")
    with pytest.raises(ValueError, match="SGLANG_UNICACHE_HICACHE_RESERVE_GB"):
        hicache.reserve_bytes()


def test_install_replaces_the_gpu_only_pieces(monkeypatch):
    from sglang.srt.mem_cache.pool_host import base, common, mha

    monkeypatch.setenv(hicache.RESERVE_ENV, "1")
    reserve = base.HICACHE_HOST_MEMORY_RESERVE_BYTES
    monkeypatch.setattr(base, "HICACHE_HOST_MEMORY_RESERVE_BYTES", reserve)
    monkeypatch.setitem(common.ALLOC_MEMORY_FUNCS, "cpu", common.ALLOC_MEMORY_FUNCS["cpu"])
    monkeypatch.setattr(mha, "transfer_kv_direct", None, raising=False)
    hicache.install()
    assert base.HICACHE_HOST_MEMORY_RESERVE_BYTES == 1024**3
    assert mha.transfer_kv_direct is hicache.transfer_kv_direct
    buffer = common.ALLOC_MEMORY_FUNCS["cpu"]((2, 3), torch.float32, "cpu", True,
                                              common.HostTensorAllocator())
    assert buffer.shape == (2, 3) and not buffer.is_pinned()


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_host_copy_round_trips_within_half_a_step(bits):
    """To a quantized host row and back: every value within half a quantization step of its
    (slot, head) scale (the scale's own bfloat16 rounding and the result's included), the row
    ``host_row_bytes`` wide."""
    from sglang_unicache.policy.quantize import QMAX, host_row_bytes

    torch.manual_seed(1)
    device = [torch.randn(12, 2, 32, dtype=torch.bfloat16) * 3 for _ in range(2)]
    host = [torch.zeros(20, 2, host_row_bytes(32, bits), dtype=torch.uint8) for _ in range(2)]
    back = [torch.zeros(12, 2, 32, dtype=torch.bfloat16) for _ in range(2)]
    at, slots = torch.arange(12), torch.randperm(20)[:12]
    hicache.transfer_kv_direct(device, host, at, slots, page_size=1)
    hicache.transfer_kv_direct(host, back, slots, at, page_size=1)
    for x, y in zip(device, back, strict=True):
        step = x.float().abs().amax(-1, keepdim=True) / QMAX[bits]
        bound = step * 0.5 * 1.02 + x.float().abs() * 2**-8
        assert ((x.float() - y.float()).abs() <= bound).all()
        assert not torch.equal(x, torch.zeros_like(x)) and (y != 0).any()
    assert host_row_bytes(32, 8) == 34 and host_row_bytes(32, 4) == 18
