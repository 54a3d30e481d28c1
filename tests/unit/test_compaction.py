"""Compaction on a real SGLang pool, driven through ``Controller.on_checkpoint``: it either
happens whole (row shorter, N - K slots back, ids and lengths rewritten) or not at all (an error
after the first write must not leave a half-compacted request)."""

from __future__ import annotations

import weakref
from array import array
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

from sglang.srt.mem_cache.allocator import (  # noqa: E402
    PagedTokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
)
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402

from sglang_unicache.engine import compress as compress_module  # noqa: E402
from sglang_unicache.engine.capture import CaptureTarget, QueryCapture  # noqa: E402
from sglang_unicache.engine.controller import Controller  # noqa: E402
from sglang_unicache.engine.request import state_of  # noqa: E402
from sglang_unicache.engine.targets import Pending  # noqa: E402
from sglang_unicache.policy.config import UniCacheConfig  # noqa: E402
from sglang_unicache.policy.inputs import page_end  # noqa: E402

LAYERS, HEADS, DIM, POOL = 2, 2, 8, 128
PAD, START, N, LENGTH = 1_000_777, 3, 32, 45  # a 32-token image at 3..35 of a 45-token prompt


class BrokenLens:
    """A batch length that cannot be updated: fails after the pool and the row were written."""

    def clone(self):
        raise RuntimeError("injected failure")


def setup(seq_lens, layers: int = LAYERS, config: UniCacheConfig | None = None, tree=None,
          dtype: torch.dtype = torch.float32, page_size: int = 1,
          shape: tuple[int, int, int] = (START, N, LENGTH), **controller_args):
    """A controller on a real pool and one request whose prefill just ran: ``shape`` is (image
    start, image tokens, prompt tokens); ``page_size`` > 1 uses SGLang's paged allocator."""
    start, n, length = shape
    size = POOL if page_size == 1 else 64 * page_size
    pool = MHATokenToKVPool(size, page_size, dtype, HEADS, DIM, layers, "cpu", False)
    allocator = (TokenToKVPoolAllocator(size, dtype, "cpu", pool, need_sort=False)
                 if page_size == 1 else
                 PagedTokenToKVPoolAllocator(size, page_size, dtype, "cpu", pool, need_sort=False))
    for layer in range(layers):
        for buf in (pool.get_key_buffer(layer), pool.get_value_buffer(layer)):
            buf[:] = torch.randn(buf.shape).to(dtype)
    req_to_token = torch.zeros(2, size, dtype=torch.int32)
    config = config or UniCacheConfig(method="knorm", keep_ratio=0.25, selfcheck=False)
    controller = Controller(config, req_to_token, pool, allocator, tree=tree, **controller_args)
    slots = allocator.alloc(page_end(length, page_size))[:length]  # whole pages
    req_to_token[1, :length] = slots.to(torch.int32)
    ids = array("q", [5] * start + [PAD] * n + [7] * (length - start - n))
    item = SimpleNamespace(offsets=[(start, start + n - 1)], pad_value=PAD,
                           modality=SimpleNamespace(name="IMAGE"))
    req = SimpleNamespace(
        rid="r", extend_end=length, origin_input_ids=ids, output_ids=[],
        full_untruncated_fill_ids=ids, return_logprob=False, session=None, beam_group=None,
        skip_radix_cache_insert=False, extra_key=None,
        cache_salt=None, multimodal_inputs=SimpleNamespace(
            mm_items=[item], mrope_positions=None, mrope_position_delta=None),
        is_retracted=False, retracted_stain=False, prefix_len=0, host_hit_length=0,
        kv=SimpleNamespace(req_pool_idx=1, kv_committed_len=length, kv_allocated_len=length,
                           cache_protected_len=0, holds_kv=False))
    target = CaptureTarget("r", 0, range(length - 4, length), range(length - 4, length))
    controller.targets.capture = QueryCapture.for_targets([target], device="cpu")
    for layer in range(layers):
        controller.targets.capture.record(layer, torch.randn(length, HEADS * DIM), DIM)
    batch = SimpleNamespace(seq_lens=seq_lens, seq_lens_cpu=None, orig_seq_lens=None,
                            seq_lens_sum=None)
    spans = controller.targets.new_image_spans(req)
    controller.targets.pending = {"r": Pending(batch, target, spans)}
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


def test_compaction_frees_through_the_plugins_one_free_path():
    """N - K slots go back through ``Slots``: the scheduler's batch-is-full mark is cleared once,
    after the allocator has them; a request that keeps its full KV clears nothing."""
    controller, req, _, allocator, _ = setup(torch.tensor([LENGTH]))
    seen = []
    controller.slots.on_free = lambda: seen.append(allocator.available_size())
    free = allocator.available_size()
    controller.on_checkpoint(req)
    assert seen == [free + N - round(0.25 * N)]
    broken, req, _, _, _ = setup(BrokenLens())
    broken.slots.on_free = lambda: seen.append("freed")
    broken.on_checkpoint(req)
    assert broken.stats.errors == 1 and seen == [free + N - round(0.25 * N)]


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
    assert state_of(req).rewrites == [] and state_of(req).removed == 0


def test_the_prompt_kv_is_read_one_layer_at_a_time(monkeypatch):
    """Compression must not copy the whole prompt's K/V for every layer at once (2 GB for a
    32k-token prompt on a 7B model, outside the pool budget). The default method, self-check
    on, over 8 layers: at no point are more than two layers' copies alive (the signals computed
    for several layers at once, ``policy/stacked.py``, copy each layer into a stack bounded by
    ``stacked.GROUP_BYTES`` and only below ``stats_chunk`` tokens). Nor does it read a
    layer more often than it must: the plan reads each layer's prompt K and V once per pass over
    the layers (scores; the self-check's reference and its statistics read the checked and
    content layers again), and the execution reads each layer of the span's own rows once."""
    controller, req, *_ = setup(torch.tensor([LENGTH]), layers=8,
                                config=UniCacheConfig(keep_ratio=0.25, selfcheck_threshold=99.0,
                                                      selfcheck_content_threshold=1.0))
    alive, peak, reads = weakref.WeakSet(), [0], Counter()
    gather = compress_module.prompt_kv

    def tracked(k_buffers, v_buffers, row):
        views = gather(k_buffers, v_buffers, row)
        for name, view in zip("kv", views, strict=True):
            def get(layer, read=view._get, name=name):
                copy = read(layer)
                if copy.shape[0] == LENGTH:
                    alive.add(copy)
                reads[name, layer, copy.shape[0]] += 1
                peak[0] = max(peak[0], len(alive))
                return copy
            view._get = get
        return views

    monkeypatch.setattr(compress_module, "prompt_kv", tracked)
    controller.on_checkpoint(req)
    assert controller.stats.images_compressed == 1 and controller.stats.errors == 0
    prompt = {(name, layer): n for (name, layer, rows), n in reads.items() if rows == LENGTH}
    span = {(name, layer): n for (name, layer, rows), n in reads.items() if rows == N}
    assert sorted(prompt) == sorted(span) == [(name, layer) for name in "kv" for layer in range(8)]
    assert max(prompt.values()) <= 3 and set(span.values()) == {1}, reads
    assert peak[0] <= 4, f"{peak[0]} prompt-length K/V copies alive at once"
    assert len(alive) == 0, "a prompt-length copy outlived the compression"


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16])
def test_a_quantized_or_half_pool_is_compressed_in_its_dtype(dtype):
    """``--kv-cache-dtype fp8_e4m3`` / ``fp8_e5m2``: the policy scores dequantized
    values and the compressed entries are written back in the pool's dtype, exactly the entries
    the pool held (eviction moves stored values, it never re-quantizes them)."""
    controller, req, pool, allocator, _ = setup(
        torch.tensor([LENGTH]), dtype=dtype,
        # random pool values are all "content": only the query half of the check is asked here
        config=UniCacheConfig(keep_ratio=0.25, selfcheck_threshold=0.9,
                              selfcheck_content_threshold=1.0))
    row = controller.req_to_token[1, :LENGTH].to(torch.int64).clone()
    before = [pool.get_key_buffer(layer).index_select(0, row).clone() for layer in range(LAYERS)]
    free = allocator.available_size()
    controller.on_checkpoint(req)
    assert controller.stats.errors == 0
    assert controller.stats.images_compressed == 1, controller.outcomes.recent_checks
    kept = N - (LENGTH - req.extend_end)
    assert allocator.available_size() == free + N - kept
    new_row = controller.req_to_token[1, :req.extend_end].to(torch.int64)
    for layer in range(LAYERS):
        span = pool.get_key_buffer(layer).index_select(0, new_row[START:START + kept])
        assert span.dtype == dtype
        source = before[layer][START:START + N]
        for head in range(HEADS):  # every entry is one of the image's stored entries, bit-exact
            stored = {tuple(e.view(torch.uint8 if dtype.itemsize == 1 else torch.int16).tolist())
                      for e in source[:, head]}
            assert all(tuple(e.view(torch.uint8 if dtype.itemsize == 1 else torch.int16)
                             .tolist()) in stored for e in span[:, head])


def test_re_compression_moves_float8_entries_as_stored():
    from sglang_unicache.engine.kvpool import move_entries

    keys = [torch.randn(16, 2, 4).to(torch.float8_e5m2) for _ in range(2)]
    values = [torch.randn(16, 2, 4).to(torch.float8_e5m2) for _ in range(2)]
    slots = torch.tensor([3, 5, 7, 9])
    keep = torch.tensor([[[1, 3], [0, 2]], [[2, 3], [0, 1]]])  # [L, H, K'] entries of the 4
    want = [[buf[slots[keep[layer, head]], head].view(torch.uint8).clone() for head in range(2)]
            for layer, buf in enumerate(keys)]
    move_entries(keys, values, slots, keep)
    for layer in range(2):
        for head in range(2):
            assert torch.equal(keys[layer][slots[:2], head].view(torch.uint8), want[layer][head])


class CopyingPool:
    """A pool whose buffers are read through a conversion (as a quantized pool dequantizes):
    every read is a new tensor, so a write into it is lost."""

    start_layer = 0

    def __init__(self, pool):
        self.pool = pool

    def get_key_buffer(self, layer):
        return self.pool.get_key_buffer(layer).float()

    def get_value_buffer(self, layer):
        return self.pool.get_value_buffer(layer).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_only_a_pool_whose_buffers_take_writes_is_accepted(dtype):
    from sglang_unicache.engine.kvpool import unwritable_pool

    pool = MHATokenToKVPool(POOL, 1, dtype, HEADS, DIM, LAYERS, "cpu", False)
    assert unwritable_pool(pool) is None  # float8 is stored as uint8 and read as a view
    half = MHATokenToKVPool(POOL, 1, torch.float16, HEADS, DIM, LAYERS, "cpu", False)
    assert unwritable_pool(CopyingPool(half)) == "CopyingPool returns a copy of its buffers"
    quantized = CopyingPool(pool)
    quantized.is_quantized_kv_cache = True  # SGLang's own flag, read first
    assert unwritable_pool(quantized) == "CopyingPool is a quantized KV cache"


def test_an_item_in_two_runs_is_served_on_its_full_kv():
    """SGLang maps an item's embeddings to its runs by summing the runs' lengths in the ids, so
    rewriting one run of a multi-run item (video frames apart, say) would shift the slice of a
    later run still prefilled: such items are neither compressed nor rewritten for reuse. Runs
    one token apart (Pixtral's row breaks) are one span and stay compressible."""
    controller, req, *_ = setup(torch.tensor([LENGTH]))
    item = req.multimodal_inputs.mm_items[0]
    assert controller.targets.image_spans(req) == [(START, START + N, PAD)]
    item.offsets = [(START, START + 15), (START + 17, START + N - 1)]  # a row break between
    assert controller.targets.image_spans(req) == [(START, START + N, PAD)]
    item.offsets = [(START, START + 12), (START + 20, START + N - 1)]  # text between the runs
    assert controller.targets.image_spans(req) == [] and controller.targets.multi_run_noted
    assert controller.targets.new_image_spans(req) == []


def test_a_prefill_the_query_hook_missed_keeps_its_full_kv():
    """A forward that ran some layers' attention past the hook (a CUDA graph, a fused path)
    left no observation queries for them: the request is not compressed on partial
    statistics, and the miss is counted."""
    controller, req, pool, allocator, _ = setup(torch.tensor([LENGTH]))
    del controller.targets.capture.queries[LAYERS - 1]
    free, row = allocator.available_size(), controller.req_to_token[1].clone()
    controller.on_checkpoint(req)
    assert controller.stats.capture_missed == 1 and controller.stats.images_compressed == 0
    assert allocator.available_size() == free and torch.equal(controller.req_to_token[1], row)
    assert req.extend_end == LENGTH


class PeerFailsToApply:
    """Two tensor-parallel ranks where the other rank fails the apply step (this one's
    succeeded): every rank must end on its full KV."""

    rank = 0

    def __init__(self):
        self.steps = []

    def shards(self, local_heads):
        from sglang_unicache.policy.ranks import ONE_RANK

        return ONE_RANK

    def settle(self, failed: bool) -> bool:
        self.steps.append(failed)
        return len(self.steps) == 1 and not failed  # the plan agreed, the apply did not

    def agree(self, fingerprint) -> bool:
        return True


def test_a_compression_another_rank_failed_to_apply_is_undone():
    controller, req, pool, allocator, batch = setup(torch.tensor([LENGTH]), tp=PeerFailsToApply())
    row = controller.req_to_token[1].clone()
    k_before = [k.clone() for k in pool.k_buffer]
    ids, free = array("q", req.origin_input_ids), allocator.available_size()
    controller.on_checkpoint(req)
    assert controller.tp.steps == [False, False]  # this rank planned and applied
    assert controller.stats.errors == 1 and controller.stats.images_compressed == 0
    assert torch.equal(controller.req_to_token[1], row)
    assert all(torch.equal(a, b) for a, b in zip(pool.k_buffer, k_before, strict=True))
    assert allocator.available_size() == free  # nothing freed
    assert req.origin_input_ids == ids and req.extend_end == LENGTH
    assert int(batch.seq_lens[0]) == LENGTH and req.kv.kv_allocated_len == LENGTH
    assert state_of(req).rewrites == [] and state_of(req).fresh is None


@pytest.mark.parametrize("method, per_request", [("snapkv", True), ("knorm", False)])
def test_a_query_dependent_span_is_keyed_by_its_request(method, per_request):
    """Two requests compressing one image in one batch: with a selection that follows the
    question, each span's ids name its request, so the second insert does not repoint the
    second request to the first one's slots (a plan never checked for it); a query-independent
    selection is the same for both, and its ids are shared."""
    config = UniCacheConfig(method=method, keep_ratio=0.25, selfcheck=False)
    ids = []
    for rid in ("a", "b"):
        controller, req, *_ = setup(torch.tensor([LENGTH]), config=config)
        req.rid = rid
        controller.targets.pending[rid] = controller.targets.pending.pop("r")
        controller.targets.pending[rid].target.rid = rid
        controller.targets.capture.starts[rid] = controller.targets.capture.starts.pop("r")
        controller.on_checkpoint(req)
        assert controller.stats.images_compressed == 1
        ((_, meta),) = state_of(req).fresh
        assert list(req.origin_input_ids[START:START + meta.count]) == list(meta.ids)
        ids.append(meta.ids)
    assert (ids[0] != ids[1]) == per_request


def test_every_exported_counter_is_counted():
    """``/metrics`` reads each of its counters from the controller's (a missing one would raise
    on the scheduler thread at the first sync)."""
    from sglang_unicache.engine.metrics import COUNTERS, GAUGES

    controller, *_ = setup(torch.tensor([LENGTH]))
    assert set(COUNTERS) <= set(controller.counters())
    assert {"capture_missed", "rank_disagreements", "errors"} <= set(COUNTERS)
    assert set(GAUGES) == set(controller.gauges())
