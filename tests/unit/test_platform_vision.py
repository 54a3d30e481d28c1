"""The CPU platform's vision attention: one ``cu_seqlens`` segment at a time gives what SGLang's
block-diagonal mask gives, and every other call still takes SGLang's own path."""

from __future__ import annotations

import pytest
import torch

from sglang_unicache.platform.cpu import vision

sglang_vision = pytest.importorskip("sglang.srt.layers.attention.vision")
HEADS, DIM = 2, 8


def attention(**kwargs):
    return sglang_vision.VisionSdpaAttention(head_dim=DIM, num_heads=HEADS, num_kv_heads=HEADS,
                                             flatten_batch=True, **kwargs)


def qkv(n: int, dtype=torch.float32):
    torch.manual_seed(0)
    return [torch.randn(n, HEADS, DIM, dtype=dtype) for _ in range(3)]


def original(module, *args, **kwargs):
    return vision.sglang_forward(type(module))(module, *args, **kwargs)


def test_segments_tile_the_sequence_or_are_refused():
    assert vision.segments(torch.tensor([0, 5, 5, 12]), 12) == [(0, 5), (5, 12)]
    assert vision.segments(torch.tensor([0, 5]), 12) is None  # patches outside every image
    assert vision.segments(torch.tensor([2, 12]), 12) is None
    assert vision.segments(torch.tensor([0, 7, 5, 12]), 12) is None
    assert vision.segments(None, 12) is None


def test_attention_by_segment_matches_the_block_diagonal_mask():
    module = attention()
    q, k, v = qkv(20)
    cu = torch.tensor([0, 5, 12, 12, 20], dtype=torch.int32)
    expected = original(module, q, k, v, bsz=1, cu_seqlens=cu)
    got = vision.forward_by_segment(module, q, k, v, bsz=1, cu_seqlens=cu)
    assert got.shape == expected.shape == (20, HEADS, DIM)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # and the images stay apart: changing the second image leaves the first one's output alone
    k2 = k.clone()
    k2[5:] = torch.randn(15, HEADS, DIM)
    moved = vision.forward_by_segment(module, q, k2, v, bsz=1, cu_seqlens=cu)
    assert torch.equal(moved[:5], got[:5])
    assert not torch.allclose(moved[5:12], got[5:12])


def test_other_calls_take_sglangs_own_path():
    module = attention()
    q, k, v = qkv(12)
    mask = torch.zeros(1, 12, 12, dtype=torch.bool)
    mask[..., :6, :6] = True
    mask[..., 6:, 6:] = True
    cu = torch.tensor([0, 12], dtype=torch.int32)
    expected = original(module, q, k, v, bsz=1, cu_seqlens=cu, attention_mask=mask)
    got = vision.forward_by_segment(module, q, k, v, bsz=1, cu_seqlens=cu, attention_mask=mask)
    torch.testing.assert_close(got, expected)  # the explicit mask, not cu_seqlens, is obeyed
    assert not torch.allclose(got, vision.forward_by_segment(module, q, k, v, bsz=1,
                                                               cu_seqlens=cu))


def test_install_routes_the_class_forward_once():
    cls = sglang_vision.VisionSdpaAttention
    installed_before = vision._ORIGINAL in cls.__dict__
    try:
        vision.install()
        vision.install()
        assert cls.forward is vision.forward_by_segment
        assert getattr(cls, vision._ORIGINAL) is not vision.forward_by_segment
        module = attention()
        q, k, v = qkv(9)
        cu = torch.tensor([0, 4, 9], dtype=torch.int32)
        torch.testing.assert_close(module(q, k, v, bsz=1, cu_seqlens=cu),
                                   original(module, q, k, v, bsz=1, cu_seqlens=cu))
    finally:
        if not installed_before:
            cls.forward = cls.__dict__[vision._ORIGINAL]
            delattr(cls, vision._ORIGINAL)


def test_the_platform_installs_it_in_each_worker(monkeypatch):
    from sglang_unicache.platform.cpu import platform as cpu_platform

    calls = []
    monkeypatch.setattr(cpu_platform.hicache, "install", lambda: None)
    monkeypatch.setattr(cpu_platform.vision, "install", lambda: calls.append("vision"))
    cpu_platform.UniCacheCpuPlatform().init_backend()
    assert calls == ["vision"]
