"""Compaction on a real SGLang pool, driven through ``Controller.on_checkpoint``: it either
happens whole (row shorter, N - K slots back, ids and lengths rewritten) or not at all (issue 14,
defect 5: an error after the first write left a half-compacted request)."""

from __future__ import annotations

import weakref
from array import array
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402

from sglang_unicache.config import UniCacheConfig  # noqa: E402
from sglang_unicache.integration import controller as controller_module  # noqa: E402
from sglang_unicache.integration.capture import CaptureTarget, QueryCapture  # noqa: E402
from sglang_unicache.integration.controller import Controller, Pending  # noqa: E402

LAYERS, HEADS, DIM, POOL = 2, 2, 8, 128
PAD, START, N, LENGTH = 1_000_777, 3, 32, 45  # a 32-token image at 3..35 of a 45-token prompt


class BrokenLens:
    """A batch length that cannot be updated: fails after the pool and the row were written."""

    def clone(self):
        raise RuntimeError("injected failure")


def setup(seq_lens, layers: int = LAYERS, config: UniCacheConfig | None = None, tree=None):
    pool = MHATokenToKVPool(POOL, 1, torch.float32, HEADS, DIM, layers, "cpu", False)
    allocator = TokenToKVPoolAllocator(POOL, torch.float32, "cpu", pool, need_sort=False)
    for layer in range(layers):
        pool.k_buffer[layer].normal_()
        pool.v_buffer[layer].normal_()
    req_to_token = torch.zeros(2, POOL, dtype=torch.int32)
    config = config or UniCacheConfig(method="knorm", keep_ratio=0.25, selfcheck=False)
    controller = Controller(config, req_to_token, pool, allocator, tree=tree)
    slots = allocator.alloc(LENGTH)
    req_to_token[1, :LENGTH] = slots.to(torch.int32)
    ids = array("q", [5] * START + [PAD] * N + [7] * (LENGTH - START - N))
    item = SimpleNamespace(offsets=[(START, START + N - 1)], pad_value=PAD,
                           modality=SimpleNamespace(name="IMAGE"))
    req = SimpleNamespace(
        rid="r", extend_end=LENGTH, origin_input_ids=ids, output_ids=[],
        full_untruncated_fill_ids=ids, return_logprob=False, session=None, extra_key=None,
        cache_salt=None, multimodal_inputs=SimpleNamespace(
            mm_items=[item], mrope_positions=None, mrope_position_delta=None),
        is_retracted=False, prefix_len=0,
        kv=SimpleNamespace(req_pool_idx=1, kv_committed_len=LENGTH, kv_allocated_len=LENGTH,
                           cache_protected_len=0, holds_kv=False))
    target = CaptureTarget("r", 0, range(LENGTH - 4, LENGTH), range(LENGTH - 4, LENGTH))
    controller.capture = QueryCapture.for_targets([target], device="cpu")
    for layer in range(layers):
        controller.capture.record(layer, torch.randn(LENGTH, HEADS * DIM), DIM)
    batch = SimpleNamespace(seq_lens=seq_lens, seq_lens_cpu=None, orig_seq_lens=None,
                            seq_lens_sum=None)
    controller.pending = {"r": Pending(batch, target, controller.new_image_spans(req))}
    return controller, req, pool, allocator, batch


def test_compaction_frees_n_minus_k_and_rewrites_the_request():
    controller, req, _, allocator, batch = setup(torch.tensor([LENGTH]))
    free = allocator.available_size()
    controller.on_checkpoint(req)
    kept = round(0.25 * N)
    assert allocator.available_size() == free + N - kept
    assert req.extend_end == LENGTH - N + kept == req.kv.kv_allocated_len
    assert len(req.origin_input_ids) == LENGTH - N + kept
    assert int(batch.seq_lens[0]) == req.extend_end
    assert req.multimodal_inputs.mm_items[0].offsets == [(START, START + kept - 1)]
    assert controller.stats.images_compressed == 1 and controller.stats.errors == 0


def test_a_failure_after_the_first_write_leaves_nothing_changed():
    controller, req, pool, allocator, _ = setup(BrokenLens())
    row = controller.req_to_token[1].clone()
    k_before = [k.clone() for k in pool.k_buffer]
    v_before = [v.clone() for v in pool.v_buffer]
    ids, free = array("q", req.origin_input_ids), allocator.available_size()
    controller.on_checkpoint(req)  # logs the error, keeps the full KV
    assert controller.stats.errors == 1 and controller.stats.images_compressed == 0
    assert torch.equal(controller.req_to_token[1], row)
    assert all(torch.equal(a, b) for a, b in zip(pool.k_buffer, k_before, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(pool.v_buffer, v_before, strict=True))
    assert allocator.available_size() == free
    assert req.origin_input_ids == ids and req.extend_end == LENGTH
    assert req.multimodal_inputs.mm_items[0].offsets == [(START, START + N - 1)]
    assert req.unicache_rewrites == [] and getattr(req, "unicache_removed", 0) == 0


def test_the_prompt_kv_is_read_one_layer_at_a_time(monkeypatch):
    """Defect 8c: compression copied the whole prompt's K/V for every layer at once (2 GB for a
    32k-token prompt on a 7B model, outside the pool budget). The default method, self-check
    on, over 8 layers: at no point are more than two layers' copies alive."""
    controller, req, *_ = setup(torch.tensor([LENGTH]), layers=8,
                                config=UniCacheConfig(keep_ratio=0.25, selfcheck_threshold=99.0))
    alive, peak, reads = weakref.WeakSet(), [0], [0]
    gather = controller_module.prompt_kv

    def tracked(k_buffers, v_buffers, row):
        views = gather(k_buffers, v_buffers, row)
        for view in views:
            def get(layer, read=view._get):
                copy = read(layer)
                alive.add(copy)
                reads[0] += 1
                peak[0] = max(peak[0], len(alive))
                return copy
            view._get = get
        return views

    monkeypatch.setattr(controller_module, "prompt_kv", tracked)
    controller.on_checkpoint(req)
    assert controller.stats.images_compressed == 1 and controller.stats.errors == 0
    assert reads[0] >= 16, "every layer's K and V was read"
    assert peak[0] <= 4, f"{peak[0]} prompt-length K/V copies alive at once"
