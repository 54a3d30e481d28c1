"""Per-round cost of the plugin's bookkeeping with a large tree (issue 14, defect 8).

Every scheduling round publishes the gauge ``compressed_slots_held`` for every waiting request
it re-matches (with ``--enable-metrics``). Before, the gauge scanned every node of the tree
(``count_held``, still what ``check_integrity`` compares against); now the radix cache keeps it as
a counter. This builds SGLang's radix cache on a real pool with many cached compressed spans and
times both, per call.

    python benchmarks/bench_matching.py --spans 2000 --waiting 64
"""

from __future__ import annotations

import argparse
import time
from array import array

import torch
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

from sglang_unicache.config import UniCacheConfig
from sglang_unicache.integration import radix_cache
from sglang_unicache.integration.controller import Controller
from sglang_unicache.integration.spans import SpanMeta

K, TEXT = 8, 6


def build(spans: int):
    radix_cache.register()
    size = spans * (K + 2 * TEXT) + 16
    pool = MHATokenToKVPool(size, 1, torch.float32, 1, 4, 1, "cpu", False)
    allocator = TokenToKVPoolAllocator(size, torch.float32, "cpu", pool, need_sort=False)
    tree = radix_cache.CompressedRadixCache(CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=allocator, page_size=1,
        tree_components=(ComponentType.FULL,), tree_core_backend=radix_cache.BACKEND))
    tree.controller = Controller(UniCacheConfig(), None, pool, allocator)
    for i in range(spans):
        ids = tree.controller.compressed_ids(1_000_000 + i, TEXT, K)
        key = RadixKey(array("q", [11 + i % 7] * TEXT + list(ids) + [21 + i] * TEXT))
        tree.insert(InsertParams(key=key, value=allocator.alloc(len(key)).to(torch.int64)))
        node = tree.match_prefix(MatchPrefixParams(key=key)).last_device_node
        meta = SpanMeta((None, None), 1_000_000 + i, TEXT, 64, ids,
                        torch.zeros(1, 1, K, dtype=torch.int32), torch.zeros(1, 1, K),
                        torch.empty(0, dtype=torch.int64), None, "unicache", 0.1)
        tree.attach(tree.node_holding(node, ids[0]), meta)
    return tree


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


if __name__ == "__main__":
    main()
