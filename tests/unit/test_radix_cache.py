"""The ``unicache`` radix cache backend on a real SGLang pool and allocator (CPU, no server):
compressed-span metadata on tree nodes, no split inside a span, re-compression under pressure."""

from __future__ import annotations

from array import array
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import (  # noqa: E402
    EvictParams,
    InsertParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType  # noqa: E402

from sglang_unicache.engine import radix_cache  # noqa: E402
from sglang_unicache.engine.kvpool import Slots  # noqa: E402
from sglang_unicache.engine.request import state_of  # noqa: E402
from sglang_unicache.engine.spans import SpanMeta  # noqa: E402
from sglang_unicache.policy.config import UniCacheConfig  # noqa: E402
from sglang_unicache.policy.keep import KeepRatio  # noqa: E402

LAYERS, HEADS, DIM, POOL = 2, 2, 4, 64
PAD, START, LENGTH, K = 1_000_123, 3, 32, 8  # a 32-token image at position 3 kept as 8 entries
PREFIX, TAIL = [11, 12, 13], [21, 22]
PROTECTED_SOURCE = 20  # one alignment-protected source token, entry 5 in every layer and head


@pytest.fixture
def cache():
    radix_cache.register()
    pool = MHATokenToKVPool(POOL, 1, torch.float32, HEADS, DIM, LAYERS, "cpu", False)
    allocator = TokenToKVPoolAllocator(POOL, torch.float32, "cpu", pool, need_sort=False)
    params = CacheInitParams(disable=False, req_to_token_pool=None,
                             token_to_kv_pool_allocator=allocator, page_size=1,
                             tree_components=(ComponentType.FULL,),
                             tree_core_backend=radix_cache.BACKEND)
    tree = radix_cache.CompressedRadixCache(params)
    config = UniCacheConfig(method="knorm", keep_ratio=0.25, recompress_factor=0.5,
                            recompress_floor=0.02)
    tree.req_to_token_pool = SimpleNamespace(req_to_token=torch.zeros(2, POOL, dtype=torch.int32))
    tree.enable_spans(radix_cache.SpanSettings.of(config), Slots(allocator))
    return tree


def fill(pool, slots: torch.Tensor) -> None:
    """Entry of slot s, layer l, head h, dim d = 1000 s + 100 l + 10 h + d (K), negated (V)."""
    for layer in range(LAYERS):
        grid = (1000 * slots.view(-1, 1, 1) + 100 * layer + 10 * torch.arange(HEADS).view(1, -1, 1)
                + torch.arange(DIM).view(1, 1, -1)).float()
        pool.k_buffer[layer][slots] = grid
        pool.v_buffer[layer][slots] = -grid


def make_span(tree) -> tuple[SpanMeta, torch.Tensor]:
    allocator = tree.token_to_kv_pool_allocator
    slots = allocator.alloc(len(PREFIX) + K + len(TAIL))
    fill(allocator.get_kvcache(), slots)
    ids = tree.settings.naming.ids(PAD, START, K)
    priority = torch.rand(LAYERS, HEADS, K, generator=torch.Generator().manual_seed(0))
    kept = torch.arange(K).repeat(LAYERS, HEADS, 1) * 4
    kept[..., 5] = PROTECTED_SOURCE
    priority[..., 5] = 9.0  # protected entries outrank every score (compressor.selection_key)
    meta = SpanMeta(namespace=(None, None), pad=PAD, start=START, length=LENGTH, ids=ids,
                    kept=kept.to(torch.int32), priority=priority,
                    merged=None, method="knorm", keep_ratio=0.25)
    key = RadixKey(array("q", PREFIX + list(ids) + TAIL))
    tree.insert(InsertParams(key=key, value=slots.to(torch.int64)))
    node_id = tree.match_prefix(MatchPrefixParams(key=key)).last_device_node
    tree.attach(tree.node_holding(node_id, ids[0]), meta)
    tree.spans.add(meta)
    return meta, slots


def matched(tree, ids) -> int:
    key = RadixKey(array("q", PREFIX + list(ids)))
    return tree.match_prefix(MatchPrefixParams(key=key)).device_prefix_len


def test_span_metadata_lives_on_the_node_that_holds_the_span(cache):
    meta, _ = make_span(cache)
    key = RadixKey(array("q", PREFIX + list(meta.ids) + TAIL))
    node = cache.match_prefix(MatchPrefixParams(key=key)).last_device_node
    assert cache.spans_at(node) == {meta.ids[0]: meta}
    assert cache.compressed_slots_held() == K
    # A second request with the same prefix and image but another question splits the node
    # after the span: the metadata moves with the span, not with the tail.
    other = RadixKey(array("q", PREFIX + list(meta.ids) + [31]))
    extra = cache.token_to_kv_pool_allocator.alloc(len(other))
    cache.insert(InsertParams(key=other, value=extra.to(torch.int64)))
    leaf = cache.match_prefix(MatchPrefixParams(key=other)).last_device_node
    span_node = cache.node_holding(leaf, meta.ids[0])
    assert radix_cache.spans_of(span_node) == {meta.ids[0]: meta}
    assert list(span_node.key.raw_token_ids())[-K:] == list(meta.ids)
    assert cache.spans_at(leaf) == {}
    assert radix_cache.spans_of(span_node.children[TAIL[0]]) == {}


def test_a_split_inside_a_compressed_span_is_refused(cache):
    meta, _ = make_span(cache)
    inside = RadixKey(array("q", PREFIX + list(meta.ids[:3]) + [99]))
    extra = cache.token_to_kv_pool_allocator.alloc(len(inside))
    with pytest.raises(radix_cache.SplitInsideSpanError):
        cache.insert(InsertParams(key=inside, value=extra.to(torch.int64)))


def test_pressure_recompresses_a_cached_span_before_evicting_it(cache):
    allocator = cache.token_to_kv_pool_allocator
    pool = allocator.get_kvcache()
    baseline = allocator.available_size()
    meta, slots = make_span(cache)
    span_slots = slots[len(PREFIX):len(PREFIX) + K]
    before_k = [pool.k_buffer[layer][span_slots].clone() for layer in range(LAYERS)]
    order = meta.priority.clone()

    cache.evict(EvictParams(num_tokens=1))

    # 8 -> 4 entries; the 2 tail tokens after the span go too.
    assert meta.count == 4 and meta.recompressions == 1
    assert allocator.available_size() == baseline - len(PREFIX) - 4
    assert matched(cache, meta.ids) == len(PREFIX) + 4  # the new ids key the shrunk span
    assert matched(cache, cache.settings.naming.ids(PAD, START, K)) == len(PREFIX)
    assert cache.spans.of_image(meta.image_key) is meta
    assert cache.recompressed.spans == 1
    assert (meta.kept == PROTECTED_SOURCE).any(-1).all()  # protected entry kept everywhere
    # Every layer and head holds its 4 highest-priority entries, in their original order.
    for layer in range(LAYERS):
        for head in range(HEADS):
            keep = order[layer, head].topk(4).indices.sort().values
            expect = before_k[layer][keep, head]
            assert torch.equal(pool.k_buffer[layer][span_slots[:4], head], expect)
            assert torch.equal(pool.v_buffer[layer][span_slots[:4], head], -expect)
    cache.sanity_check()  # SGLang's own tree invariants: structure, leaf sets, LRU, sizes

    cache.evict(EvictParams(num_tokens=1))
    cache.evict(EvictParams(num_tokens=1))
    assert meta.count == 1 and (meta.kept == PROTECTED_SOURCE).all()  # at its floor
    cache.evict(EvictParams(num_tokens=1))  # a span at its floor is evicted whole
    assert matched(cache, meta.ids) == len(PREFIX)  # (matching split the prefix off earlier)
    assert cache.compressed_slots_held() == 0
    assert cache.spans.of_image(meta.image_key) is None  # metadata died with it
    cache.evict(EvictParams(num_tokens=POOL))
    assert allocator.available_size() == baseline  # nothing leaked
    cache.sanity_check()


def test_recompression_frees_through_the_plugins_one_free_path(cache):
    """The slots a re-compression drops go back through ``Slots`` (which clears the scheduler's
    batch-is-full mark), not straight to the allocator."""
    freed = []
    cache.slots.on_free = lambda: freed.append(cache.token_to_kv_pool_allocator.available_size())
    before = cache.token_to_kv_pool_allocator.available_size()
    make_span(cache)
    cache.evict(EvictParams(num_tokens=1))
    assert freed and freed[-1] > before - len(PREFIX) - K - len(TAIL)


def test_alignment_protected_entries_are_shrunk_last_not_a_floor(cache):
    """A span whose every entry is alignment-protected (a uniform budget fills the smallest layer
    with them) is halved under pressure like any other: protection ranks entries, it does not
    freeze the span. As a floor it would make re-compression evict such spans whole."""
    allocator = cache.token_to_kv_pool_allocator
    baseline = allocator.available_size()
    meta, _ = make_span(cache)
    meta.priority = meta.priority + 9.0  # every entry ranks as protected
    order = meta.kept.clone()
    keep = meta.priority.topk(K // 2).indices.sort().values

    cache.evict(EvictParams(num_tokens=1))

    assert meta.count == K // 2 and meta.recompressions == 1
    assert torch.equal(meta.kept, order.gather(-1, keep))  # the highest-ranked protected ones
    assert matched(cache, meta.ids) == len(PREFIX) + K // 2
    cache.sanity_check()
    cache.evict(EvictParams(num_tokens=POOL))
    assert allocator.available_size() == baseline
    cache.sanity_check()


def test_recompression_onto_a_sibling_with_the_same_key_evicts_instead(cache):
    """Shrinking a span to the K of a same-image sibling would re-key the node over the
    sibling, and the next eviction would raise KeyError (the scheduler would die)."""
    allocator = cache.token_to_kv_pool_allocator
    baseline = allocator.available_size()
    meta, _ = make_span(cache)  # K = 8 under PREFIX, the least recently used leaf
    small_ids = cache.settings.naming.ids(PAD, START, K // 2)
    key = RadixKey(array("q", PREFIX + list(small_ids) + TAIL))
    slots = allocator.alloc(len(key))
    cache.insert(InsertParams(key=key, value=slots.to(torch.int64)))
    sibling = cache.match_prefix(MatchPrefixParams(key=key)).last_device_node
    prefix_node = cache.node_holding(sibling, small_ids[0]).parent
    assert len(prefix_node.children) == 2

    cache.evict(EvictParams(num_tokens=1))  # shrinking 8 -> 4 would land on the sibling's key
    assert meta.count == K and meta.recompressions == 0
    assert matched(cache, meta.ids) == len(PREFIX)  # the K = 8 copy was evicted whole
    assert matched(cache, small_ids) == len(PREFIX) + K // 2  # the sibling is untouched
    cache.sanity_check()
    cache.evict(EvictParams(num_tokens=POOL))
    assert allocator.available_size() == baseline
    cache.sanity_check()


def test_a_flush_forgets_every_span(cache):
    meta, _ = make_span(cache)
    assert cache.spans.of_image(meta.image_key) is meta
    cache.reset()
    assert len(cache.spans) == 0 and cache.compressed_slots_held() == 0


def test_one_eviction_call_shrinks_and_then_evicts_as_far_as_it_was_asked(cache):
    """Found by the soak: after one shrink the walk had no leaf left, so a large request for
    space freed only that shrink; the allocation after it failed and the scheduler died."""
    allocator = cache.token_to_kv_pool_allocator
    baseline = allocator.available_size()
    meta, _ = make_span(cache)
    evicted = cache.evict(EvictParams(num_tokens=POOL)).num_tokens_evicted
    assert allocator.available_size() == baseline  # shrunk to its floor, then evicted whole
    assert evicted == len(PREFIX) + K + len(TAIL)
    assert meta.recompressions == 3 and cache.compressed_slots_held() == 0
    cache.sanity_check()


def test_a_shrunk_span_goes_to_the_back_of_the_eviction_order(cache):
    """A shrink counts as a touch: the next shrink takes another span (fair re-compression)."""
    first, _ = make_span(cache)
    allocator = cache.token_to_kv_pool_allocator
    other_ids = cache.settings.naming.ids(PAD + 1, START, K)
    second = SpanMeta(namespace=(None, None), pad=PAD + 1, start=START, length=LENGTH,
                      ids=other_ids, kept=first.kept.clone(), priority=first.priority.clone(),
                      merged=None, method="knorm", keep_ratio=0.25)
    key = RadixKey(array("q", PREFIX + list(other_ids) + TAIL))
    cache.insert(InsertParams(key=key, value=allocator.alloc(len(key)).to(torch.int64)))
    node = cache.match_prefix(MatchPrefixParams(key=key)).last_device_node
    cache.attach(cache.node_holding(node, other_ids[0]), second)
    cache.evict(EvictParams(num_tokens=1))  # shrinks the older span
    cache.evict(EvictParams(num_tokens=1))  # then the other one, not the shrunk one again
    assert (first.recompressions, second.recompressions) == (1, 1)
    cache.sanity_check()


def test_a_demoted_span_keeps_its_metadata_and_dies_with_its_host_copy(cache):
    """HiCache's moves, through the tree core: a demotion (the host copy kept) frees the span's
    device slots but keeps its metadata and index entry; the host tier evicting the node then
    drops both. ``held`` and ``host.spans`` follow, and the integrity check agrees."""
    from sglang_unicache.engine.integrity import _check_spans

    meta, _ = make_span(cache)
    key = RadixKey(array("q", PREFIX + list(meta.ids) + TAIL))
    node = cache.tree_core.node_by_id(cache.node_holding(
        cache.match_prefix(MatchPrefixParams(key=key)).last_device_node, meta.ids[0]).id)
    full = node.component(radix_cache.FULL)
    full.host_value = torch.arange(full.value.numel())
    assert cache.held == K and cache.host.spans == 0
    cache._demote(node.id, {radix_cache.FULL: 0})  # what eviction does to a backed-up leaf
    assert full.value is None and radix_cache.spans_of(node) == {meta.ids[0]: meta}
    assert cache.held == 0 and cache.host.spans == 1
    assert cache.spans.of_image(meta.image_key) is meta
    assert _check_spans(cache) == []
    from collections import defaultdict

    host_frees = defaultdict(list)
    cache.tree_core._evict_host_leaf(node, defaultdict(int), defaultdict(list), host_frees, [])
    assert sum(len(f) for f in host_frees[radix_cache.FULL]) == len(PREFIX + TAIL) + K
    assert cache.host.spans == 0 and cache.spans.of_image(meta.image_key) is None
    assert _check_spans(cache) == []


def rest_setup(cache, *, escalated=True, copy=True):
    """A span the check escalated (keep 0.5, the config's 0.125: 4 entries at rest) whose
    image has a host copy, entered through a request's release as the scheduler does, with an
    answer node below it; (meta, the request, the span's node)."""
    cache.settings = replace(cache.settings, keep=KeepRatio(keep_ratio=0.125))
    copies = {"copy of image"} if copy else set()
    cache.recall = SimpleNamespace(holds=lambda key: key in copies)
    meta, slots = make_span(cache)
    meta.keep_ratio = 0.5 if escalated else 0.125
    meta.host = "copy of image"
    answer = RadixKey(array("q", PREFIX + list(meta.ids) + TAIL + ANSWER))
    extra = cache.token_to_kv_pool_allocator.alloc(len(ANSWER))
    fill(cache.token_to_kv_pool_allocator.get_kvcache(), extra)
    cache.insert(InsertParams(key=answer, value=torch.cat([slots, extra]).to(torch.int64),
                              prev_prefix_len=len(slots)))  # the prefix is the tree's own
    leaf = cache.match_prefix(MatchPrefixParams(key=answer)).last_device_node
    node = cache.node_holding(leaf, meta.ids[0])
    # The request that compressed it: its row holds the span; its release moves it to the tree.
    row = cache.req_to_token_pool.req_to_token[0]
    row[:len(PREFIX) + K] = slots[:len(PREFIX) + K]
    req = SimpleNamespace(kv=SimpleNamespace(req_pool_idx=0), last_node=leaf)
    meta.slots = slots[len(PREFIX):len(PREFIX) + K].to(torch.int32)
    cache.spans.discard(meta)
    state_of(req).fresh = [(len(PREFIX), meta)]
    cache._attach_fresh(req)
    return meta, req, leaf, cache.tree_core.node_by_id(node.id)


ANSWER = [41, 42]


def test_an_escalated_span_with_a_host_copy_goes_back_to_the_keep_ratio_once_unused(cache):
    """At rest a later question recalls the image from its host copy: the span the check
    escalated for its own question goes back to keep_ratio x N entries once no request uses
    it, and the question and answer after it stay cached (a chat's next turn reuses them)."""
    allocator = cache.token_to_kv_pool_allocator
    pool = allocator.get_kvcache()
    baseline = allocator.available_size()
    meta, req, leaf, node = rest_setup(cache)
    tail_slots = node.component(radix_cache.FULL).value[-len(TAIL):].clone()
    tail_k = pool.k_buffer[0][tail_slots].clone()
    lock = cache.lock(leaf)  # a request decoding on it
    cache.on_release(req, checkpointed=True)
    assert meta.count == K  # in use: kept as it is

    cache.unlock(lock)
    cache.on_release(req, checkpointed=True)

    assert meta.count == 4 and cache.recompressed.at_rest == 1
    assert cache.compressed_slots_held() == 4
    ids = list(meta.ids)
    assert matched(cache, ids + TAIL + ANSWER) == len(PREFIX) + 4 + len(TAIL) + len(ANSWER)
    assert matched(cache, list(cache.settings.naming.ids(PAD, START, K))) == len(PREFIX)
    value = node.component(radix_cache.FULL).value
    assert torch.equal(value[-len(TAIL):], tail_slots)  # the text after it, in place
    assert torch.equal(pool.k_buffer[0][tail_slots], tail_k)
    assert allocator.available_size() == baseline - len(PREFIX) - 4 - len(TAIL) - len(ANSWER)
    assert not cache.resting
    cache.sanity_check()
    cache.evict(EvictParams(num_tokens=POOL))
    assert allocator.available_size() == baseline  # nothing leaked
    cache.sanity_check()


@pytest.mark.parametrize("case", ["not escalated", "no host copy", "turned off"])
def test_a_span_stays_as_it_is_at_rest_without_an_escalation_or_a_host_copy(cache, case):
    """Without a host copy the span is what later questions reuse: it keeps what its check
    chose. One planned at the keep ratio has nothing to give back."""
    meta, req, *_ = rest_setup(cache, escalated=case != "not escalated",
                               copy=case != "no host copy")
    if case == "turned off":
        cache.settings = replace(cache.settings, rest_at_keep_ratio=False)
    cache.on_release(req, checkpointed=True)
    assert meta.count == K and cache.recompressed.at_rest == 0
    cache.sanity_check()


def test_a_paged_span_rests_on_a_page_boundary_and_frees_whole_pages():
    """Page size 4: a 9-entry span after 3 prefix tokens ends on a page boundary; at rest it
    keeps 5 entries (keep 0.125's 4, to the end of its page), the page after them is freed and
    the tail pages stay, still matched."""
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator

    radix_cache.register()
    page, count, tail, answer = 4, 9, [21, 22, 23, 24], [41, 42, 43, 44]
    pool = MHATokenToKVPool(POOL, page, torch.float32, HEADS, DIM, LAYERS, "cpu", False)
    allocator = PagedTokenToKVPoolAllocator(POOL, page, torch.float32, "cpu", pool,
                                            need_sort=False)
    params = CacheInitParams(disable=False, req_to_token_pool=None,
                             token_to_kv_pool_allocator=allocator, page_size=page,
                             tree_components=(ComponentType.FULL,),
                             tree_core_backend=radix_cache.BACKEND)
    tree = radix_cache.CompressedRadixCache(params)
    config = UniCacheConfig(method="knorm", keep_ratio=0.125)
    tree.req_to_token_pool = SimpleNamespace(req_to_token=torch.zeros(2, POOL, dtype=torch.int32))
    tree.enable_spans(radix_cache.SpanSettings.of(config), Slots(allocator),
                      recall=SimpleNamespace(holds=lambda key: key == "copy"))
    baseline = allocator.available_size()
    slots = allocator.alloc(len(PREFIX) + count + len(tail) + len(answer))
    fill(pool, slots)
    ids = tree.settings.naming.ids(PAD, START, count)
    g = torch.Generator().manual_seed(0)
    meta = SpanMeta(namespace=(None, None), pad=PAD, start=START, length=LENGTH, ids=ids,
                    kept=torch.arange(count).repeat(LAYERS, HEADS, 1).to(torch.int32),
                    priority=torch.rand(LAYERS, HEADS, count, generator=g), merged=None,
                    method="knorm", keep_ratio=0.5, host="copy")
    key = RadixKey(array("q", PREFIX + list(ids) + tail + answer))
    tree.insert(InsertParams(key=key, value=slots.to(torch.int64)))
    leaf = tree.match_prefix(MatchPrefixParams(key=key)).last_device_node
    row = tree.req_to_token_pool.req_to_token[0]
    row[:len(slots)] = slots
    meta.slots = slots[len(PREFIX):len(PREFIX) + count].to(torch.int32)
    req = SimpleNamespace(kv=SimpleNamespace(req_pool_idx=0), last_node=leaf)
    state_of(req).fresh = [(len(PREFIX), meta)]
    tree._attach_fresh(req)

    tree.on_release(req, checkpointed=True)

    assert meta.count == 5 and tree.recompressed.at_rest == 1
    assert allocator.available_size() == baseline - len(slots) + page  # one whole page back
    assert matched(tree, list(meta.ids) + tail + answer) == len(PREFIX) + 5 + 8
    assert len(allocator.get_all_free_pages().unique()) * page == allocator.available_size()
    tree.sanity_check()
    tree.evict(EvictParams(num_tokens=POOL))
    assert allocator.available_size() == baseline


def test_a_span_whose_node_was_split_after_it_still_rests(cache):
    """Another question after the same span splits its node: the span moves to the new node
    above, and still goes back to the keep ratio at its release."""
    meta, req, leaf, node = rest_setup(cache)
    slots = node.component(radix_cache.FULL).value[:len(PREFIX) + K]
    other = RadixKey(array("q", PREFIX + list(meta.ids) + [99]))
    extra = cache.token_to_kv_pool_allocator.alloc(1)
    cache.insert(InsertParams(key=other, value=torch.cat([slots, extra]).to(torch.int64),
                              prev_prefix_len=len(slots)))
    assert radix_cache.spans_of(node) == {}  # the span moved up with the split

    cache.on_release(req, checkpointed=True)

    assert meta.count == 4 and cache.recompressed.at_rest == 1
    assert matched(cache, list(meta.ids) + [99]) == len(PREFIX) + 4 + 1
    cache.sanity_check()
