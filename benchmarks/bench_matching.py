"""Per-round cost of the plugin's bookkeeping with a large tree.

Every scheduling round re-matches every waiting request and publishes the gauge
``compressed_slots_held`` (with ``--enable-metrics``). Two costs grew with the wrong thing:

- the gauge scanned every node of the tree (``count_held``, still what ``check_integrity``
  compares against); now the radix cache keeps it as a counter;
- each waiting request redid restore, rewrite and its prefix matches every round; now the
  decision is kept until the span index changes (``SpanIndex.epoch``), and a round costs one
  match, as for any request.

This builds SGLang's radix cache on a real pool with many cached compressed spans, and waiting
requests that each reuse one of them, and times both, before and after.

    python -m benchmarks.bench_matching --spans 2000 --waiting 64
"""

from __future__ import annotations

import argparse
import time
from array import array
from types import SimpleNamespace

import torch
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

from sglang_unicache.engine import radix_cache
from sglang_unicache.engine.controller import Controller
from sglang_unicache.engine.kvpool import Slots
from sglang_unicache.engine.request import state_of
from sglang_unicache.engine.spans import SpanMeta
from sglang_unicache.policy.config import UniCacheConfig

K, TEXT = 8, 6


def build(spans: int):
    radix_cache.register()
    size = spans * (K + 2 * TEXT) + 16
    pool = MHATokenToKVPool(size, 1, torch.float32, 1, 4, 1, "cpu", False)
    allocator = TokenToKVPoolAllocator(size, torch.float32, "cpu", pool, need_sort=False)
    tree = radix_cache.CompressedRadixCache(CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=allocator, page_size=1,
        tree_components=(ComponentType.FULL,), tree_core_backend=radix_cache.BACKEND))
    tree.enable_spans(radix_cache.SpanSettings.of(UniCacheConfig()), Slots(allocator))
    for i in range(spans):
        ids = tree.settings.naming.ids(1_000_000 + i, TEXT, K)
        key = RadixKey(array("q", [11 + i % 7] * TEXT + list(ids) + [21 + i] * TEXT))
        tree.insert(InsertParams(key=key, value=allocator.alloc(len(key)).to(torch.int64)))
        node = tree.match_prefix(MatchPrefixParams(key=key)).last_device_node
        meta = SpanMeta((None, None), 1_000_000 + i, TEXT, 64, ids,
                        torch.zeros(1, 1, K, dtype=torch.int32), torch.zeros(1, 1, K),
                        None, "unicache", 0.1)
        tree.attach(tree.node_holding(node, ids[0]), meta)
        tree.spans.add(meta)
    return tree


N = 64  # image tokens of each span


def waiting_request(i: int):
    """A request about cached image ``i`` with a new question (the shape ``Controller`` reads)."""
    ids = array("q", [11 + i % 7] * TEXT + [1_000_000 + i] * N + [99] * TEXT)
    item = SimpleNamespace(offsets=[(TEXT, TEXT + N - 1)], pad_value=1_000_000 + i,
                           modality=SimpleNamespace(name="IMAGE"))
    return SimpleNamespace(
        rid=f"w{i}", origin_input_ids=ids, output_ids=[], return_logprob=False, session=None,
        extra_key=None, cache_salt=None, is_retracted=False, retracted_stain=False, prefix_len=0,
        host_hit_length=0,
        multimodal_inputs=SimpleNamespace(mm_items=[item], mrope_positions=None,
                                          mrope_position_delta=None),
        kv=SimpleNamespace(holds_kv=False))


def round_cost(tree, waiting: int, decide_every_round: bool) -> float:
    controller = Controller(UniCacheConfig(), None, None, tree.token_to_kv_pool_allocator)
    controller.tree = tree
    reqs = [waiting_request(i) for i in range(waiting)]

    def one_round() -> None:
        for req in reqs:
            if decide_every_round:
                state_of(req).matched = None  # what every round did before

            def match(req=req) -> None:
                key = RadixKey(array("q", req.origin_input_ids))
                req.prefix_len = tree.match_prefix(MatchPrefixParams(key=key)).device_prefix_len

            controller.match_with_reuse(match, req)

    one_round()
    assert all(len(r.origin_input_ids) == 2 * TEXT + K for r in reqs), "every span reused"
    return per_call(one_round, 20)


def per_call(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=2000)
    parser.add_argument("--waiting", type=int, default=64, help="waiting requests per round")
    args = parser.parse_args()
    tree = build(args.spans)
    assert tree.compressed_slots_held() == tree.count_held() == args.spans * K
    before = per_call(tree.count_held, 20)
    after = per_call(tree.compressed_slots_held, 2000)
    print(f"| tree: {args.spans} cached spans, {len(tree.tree_core._node_arena)} nodes | "
          f"per call | per round ({args.waiting} waiting requests) |")
    print("|---|---|---|")
    print(f"| before: scan every node | {before * 1e3:.2f} ms | "
          f"{before * args.waiting * 1e3:.1f} ms |")
    print(f"| after: counter | {after * 1e6:.2f} us | {after * args.waiting * 1e3:.3f} ms |")
    decided = round_cost(tree, args.waiting, decide_every_round=True)
    kept = round_cost(tree, args.waiting, decide_every_round=False)
    print()
    print(f"| reuse matching, {args.waiting} waiting requests each reusing a cached span | "
          "per round |")
    print("|---|---|")
    print(f"| before: restore + rewrite + match, every round | {decided * 1e3:.2f} ms |")
    print(f"| after: decided once per span-index change, one match | {kept * 1e3:.2f} ms |")


if __name__ == "__main__":
    main()
