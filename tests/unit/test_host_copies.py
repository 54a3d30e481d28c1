"""The host store of full image spans: packing, the byte budget's LRU, keys, its own check."""

from __future__ import annotations

import pytest
import torch

from sglang_unicache.engine.flags import UniCacheFlagError, build_config
from sglang_unicache.engine.host_copies import HostCopies, host_key
from sglang_unicache.policy.quantize import host_row_bytes

N, H, D, LAYERS = 64, 2, 16, 2


def store(budget: int, quantized: bool = True) -> HostCopies:
    return HostCopies(budget, quantized, D, torch.bfloat16)


def layers(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(N, H, D, generator=gen).to(torch.bfloat16) for _ in range(LAYERS)]


def put(copies: HostCopies, name: int) -> None:
    keys, values = layers(name), layers(name + 100)
    copies.put(("ns", name), copies.pack(keys), copies.pack(values))


def test_int8_copies_round_trip_within_half_a_step_and_take_their_bytes():
    copies = store(1 << 20)
    k = layers(0)[0]
    (packed,) = copies.pack([k])
    assert packed.dtype == torch.uint8 and packed.shape == (N, H, host_row_bytes(D, 8))
    back = copies.unpack(packed, "cpu").float()
    step = k.float().abs().amax(dim=-1, keepdim=True) / 127
    # half a code step, and the rounding of the result to bfloat16 (the pool's dtype)
    assert ((back - k.float()).abs() <= step * 0.51 + k.float().abs() * 2**-8).all()
    put(copies, 1)
    assert copies.nbytes == 2 * LAYERS * N * H * host_row_bytes(D, 8)
    # int8 rows and a bfloat16 scale: (D + 2) / 2D of the bfloat16 KV's bytes.
    assert copies.nbytes / (2 * LAYERS * N * H * D * 2) == pytest.approx((D + 2) / (2 * D))


def test_exact_copies_are_bit_exact():
    copies = store(1 << 20, quantized=False)
    k = layers(3)[0]
    assert torch.equal(copies.unpack(copies.pack([k])[0], "cpu"), k)


@pytest.mark.parametrize("quantized", [True, False])
def test_layers_packed_together_are_each_packed_alone(quantized):
    """``pack`` takes every layer in one pass: each layer's rows are what it gives that layer
    alone."""
    copies = store(1 << 20, quantized=quantized)
    ks = layers(5)
    together = copies.pack(ks)
    assert len(together) == LAYERS
    for k, packed in zip(ks, together, strict=True):
        (alone,) = copies.pack([k])
        assert torch.equal(packed, alone) and packed.is_contiguous()


def test_the_least_recently_used_copy_leaves_for_the_budget():
    one = 2 * LAYERS * N * H * host_row_bytes(D, 8)
    copies = store(2 * one + one // 2)
    for name in (1, 2):
        put(copies, name)
    assert copies.get(("ns", 1)) is not None  # 1 is now the most recently used
    epoch = copies.epoch
    put(copies, 3)
    assert ("ns", 2) not in copies and ("ns", 1) in copies and ("ns", 3) in copies
    assert copies.counters.evicted == 1 and copies.epoch > epoch
    assert copies.nbytes == 2 * one and copies.check() == []
    copies.nbytes += 1
    assert copies.check() == [f"host copies hold {2 * one} bytes, {2 * one + 1} counted"]


def test_a_copy_over_the_whole_budget_is_not_kept():
    copies = store(100)
    put(copies, 1)
    assert len(copies) == 0 and copies.nbytes == 0


def test_a_key_names_the_prompt_before_the_image():
    ids = [1, 2, 3, 4, 9, 9, 9, 5]
    key = host_key(("a", None), 9, 4, 3, ids)
    assert key == host_key(("a", None), 9, 4, 3, ids[:4] + [7, 7, 7])  # only what precedes
    assert key != host_key(("a", None), 9, 4, 3, [1, 2, 3, 6] + ids[4:])
    assert key != host_key(("b", None), 9, 4, 3, ids)  # another tenant


def test_host_copy_flags_are_validated_in_one_line():
    config = build_config(True, None, {"host_copies": "exact", "host_copy_gb": "0.5"})
    assert config.host_copies == "exact" and config.host_copy_gb == 0.5
    assert build_config(True, None, {}).host_copies == "int8"  # the default
    with pytest.raises(UniCacheFlagError, match="--unicache-host-copies: .*host_copies"):
        build_config(True, None, {"host_copies": "fp4"})
    with pytest.raises(UniCacheFlagError, match="--unicache-host-copy-gb: .*>= 0"):
        build_config(True, None, {"host_copy_gb": "-1"})
