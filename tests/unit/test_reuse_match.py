"""Reuse matching of waiting requests: a request waits many rounds and is
matched every round; which compressed spans to rewrite it to is decided again only when the
spans the tree holds changed."""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

from sglang_unicache.engine.controller import Controller  # noqa: E402
from sglang_unicache.engine.spans import SpanIndex, SpanMeta  # noqa: E402
from sglang_unicache.policy.config import UniCacheConfig  # noqa: E402
from tests.unit.test_compaction import LENGTH, PAD, START, N, setup  # noqa: E402
from tests.unit.test_radix_cache import cache  # noqa: E402, F401

K = 8


def waiting(tree_holds: int):
    """A controller whose tree holds the request's image as a K-entry span, and the request; the
    fake match finds ``tree_holds`` tokens of the request's current ids in the tree."""
    index = SpanIndex()
    tree = SimpleNamespace(spans=index, enable_spans=lambda settings, slots, recall: None)
    controller, req, *_ = setup(torch.tensor([LENGTH]), tree=tree,
                                config=UniCacheConfig(keep_ratio=0.25))
    meta = SpanMeta(namespace=(None, None), pad=PAD, start=START, length=N,
                    ids=controller.naming.ids(PAD, START, K),
                    kept=torch.zeros(1, 1, K, dtype=torch.int32), priority=torch.zeros(1, 1, K),
                    merged=None, method="unicache", keep_ratio=0.25)
    index.add(meta)
    seen = []

    def match():
        seen.append(list(req.origin_input_ids))
        req.prefix_len = min(tree_holds, len(req.origin_input_ids) - 1)

    return controller, req, index, meta, seen, match


def test_a_covered_span_stays_rewritten_without_being_decided_again():
    controller, req, index, meta, seen, match = waiting(tree_holds=LENGTH)
    for _ in range(5):
        controller.match_with_reuse(match, req)
    assert len(seen) == 5  # SGLang's own match, once per round
    assert all(ids[START:START + K] == list(meta.ids) for ids in seen)
    assert len(req.origin_input_ids) == LENGTH - (N - K)
    assert controller.stats.spans_reused == 1  # decided once, not once per round


def test_an_uncovered_span_costs_one_match_per_round_after_the_first():
    """The tree holds the text before the image but not the span: the first round tries the
    rewrite and falls back (two matches); later rounds run one match on the original ids."""
    controller, req, index, meta, seen, match = waiting(tree_holds=START)
    for _ in range(5):
        controller.match_with_reuse(match, req)
    assert len(seen) == 2 + 4
    assert all(ids[START] == PAD for ids in seen[1:])
    assert len(req.origin_input_ids) == LENGTH
    assert controller.stats.spans_reused == 0


def test_a_change_of_the_spans_is_decided_again():
    controller, req, index, meta, seen, match = waiting(tree_holds=LENGTH)
    controller.match_with_reuse(match, req)
    assert len(req.origin_input_ids) == LENGTH - (N - K)
    index.discard(meta)  # evicted while the request waited
    controller.match_with_reuse(match, req)
    assert seen[-1][START] == PAD and len(req.origin_input_ids) == LENGTH
    index.add(meta)
    controller.match_with_reuse(match, req)
    assert seen[-1][START:START + K] == list(meta.ids)


def test_a_prompt_ending_in_a_cached_image_does_not_split_the_span(cache):  # noqa: F811
    """SGLang matches at most the prompt's length - 1 tokens of the ids it is given.
    A prompt that ends in a cached image, rewritten to the span's K ids, would be matched one
    id short of the span's end: the radix tree would split the node inside the span and
    ``SplitInsideSpanError`` would escape from the scheduler's match. A span past the cap is not
    rewritten; the request matches its text prefix on its own ids."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from tests.unit import test_radix_cache as tree_test

    allocator = cache.token_to_kv_pool_allocator
    controller = Controller(UniCacheConfig(method="knorm", keep_ratio=0.25),
                            cache.req_to_token_pool.req_to_token, allocator.get_kvcache(),
                            allocator, tree=cache)
    meta, _ = tree_test.make_span(cache)
    ids = array("q", tree_test.PREFIX + [tree_test.PAD] * tree_test.LENGTH)  # ends in the image
    item = SimpleNamespace(offsets=[(tree_test.START, len(ids) - 1)], pad_value=tree_test.PAD,
                           modality=SimpleNamespace(name="IMAGE"))
    req = SimpleNamespace(
        rid="r", origin_input_ids=ids, output_ids=[], return_logprob=False, session=None,
        beam_group=None, skip_radix_cache_insert=False, extra_key=None, cache_salt=None,
        is_retracted=False, retracted_stain=False, prefix_len=0, host_hit_length=0,
        multimodal_inputs=SimpleNamespace(mm_items=[item], mrope_positions=None,
                                          mrope_position_delta=None),
        kv=SimpleNamespace(holds_kv=False))

    def match():  # as Req.init_next_round_input: the key capped at the prompt's length - 1
        key = RadixKey(array("q", req.origin_input_ids[:len(req.origin_input_ids) - 1]))
        req.prefix_len = cache.match_prefix(MatchPrefixParams(key=key)).device_prefix_len

    controller.match_with_reuse(match, req)
    assert req.prefix_len == len(tree_test.PREFIX)
    assert list(req.origin_input_ids) == list(ids)  # not rewritten
    assert cache.spans.of_image(meta.image_key) is meta


def test_a_span_held_in_the_host_tier_counts_as_covered():
    """With HiCache the device match may end before the span, which the host tier holds: the
    match's host hit covers it, so the request keeps the rewrite and admission loads it back."""
    controller, req, index, meta, seen, _ = waiting(tree_holds=START)

    def match():
        seen.append(list(req.origin_input_ids))
        req.prefix_len = START  # the text before the image is on the device
        req.host_hit_length = K + 2  # the span and two tokens after it are in host memory

    controller.match_with_reuse(match, req)
    assert seen[-1][START:START + K] == list(meta.ids)
    assert len(req.origin_input_ids) == LENGTH - (N - K)
    assert controller.stats.spans_reused == 1


def test_every_cached_copy_of_an_image_stays_findable():
    """The same image cached under two prefixes (two system prompts: same image key, same ids)
    or by two requests of a query-dependent method (other ids): evicting the newest copy leaves
    the other indexed, and a request whose prefix holds only the older copy's ids still reuses
    it (the match tries the image's next copy when the first is not on its path)."""
    controller, req, index, older, seen, _ = waiting(tree_holds=LENGTH)
    newer = SpanMeta(namespace=(None, None), pad=PAD, start=START, length=N,
                     ids=controller.naming.ids(PAD, START, K, "another request"),
                     kept=older.kept, priority=older.priority, merged=None, method="unicache",
                     keep_ratio=0.25)
    index.add(newer)
    assert index.of_image(older.image_key) is newer
    assert index.id_choices(older.image_key) == [newer.ids, older.ids]

    def match():  # the request's prefix holds the older copy only
        seen.append(list(req.origin_input_ids))
        on_path = req.origin_input_ids[START:START + K].tolist() == list(older.ids)
        req.prefix_len = LENGTH - (N - K) - 1 if on_path else START

    controller.match_with_reuse(match, req)
    assert seen[0][START:START + K] == list(newer.ids)  # the newest copy is tried first
    assert seen[1][START:START + K] == list(older.ids)
    assert len(req.origin_input_ids) == LENGTH - (N - K)
    assert controller.stats.spans_reused == 1
    index.discard(newer)  # evicted: the older copy is still found
    assert index.of_image(older.image_key) is older and len(index) == 1
    index.discard(older)
    assert index.of_image(older.image_key) is None and len(index) == 0
