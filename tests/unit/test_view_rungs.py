"""Where a request's own view starts (``view_rungs``), as the controller resolves it: a rung up
the ladder only where its span rests at ``keep_ratio`` afterwards (host copies on) and the
self-check's ladder is on; exactly ``keep_ratio`` otherwise."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("sglang")

from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402

from sglang_unicache.engine.controller import Controller  # noqa: E402
from sglang_unicache.engine.flags import UniCacheFlagError, build_config  # noqa: E402
from sglang_unicache.policy.config import UniCacheConfig  # noqa: E402


class Tree:
    """What the controller asks of the radix cache at start-up."""

    def enable_spans(self, settings, slots, recall=None) -> None:
        self.recall = recall


def controller_for(config: dict, tree: Tree) -> Controller:
    """A controller over a small real SGLang pool, as the scheduler builds it at start-up."""
    pool = MHATokenToKVPool(64, 1, torch.float32, 2, 8, 2, "cpu", False)
    allocator = TokenToKVPoolAllocator(64, torch.float32, "cpu", pool, need_sort=False)
    return Controller(UniCacheConfig(**config), torch.zeros(2, 64, dtype=torch.int32), pool,
                      allocator, tree=tree)


@pytest.mark.parametrize("config,copies,rungs", [
    ({}, True, 1),  # the defaults: keep 0.1 -> a view of keep 0.141
    ({"selfcheck": False}, True, 0),  # the user asked for exactly keep_ratio
    ({"view_rungs": 2, "view_max_keep": 0.25}, True, 2),
    ({"view_rungs": 0}, True, 0),
    ({"host_copies": "off"}, False, 0),  # the view is the span later questions share
    ({"host_copies": "off", "view_rungs": 2}, False, 0),
    ({"method": "knorm"}, False, 0),  # no copies: its entries do not follow the question
])
def test_the_view_starts_a_rung_up_only_with_host_copies_and_the_check(config, copies, rungs):
    tree = Tree()
    controller = controller_for(config, tree)
    assert (tree.recall is not None) == copies
    assert controller.config.view_rungs == rungs
    assert controller.method.keep.start() == pytest.approx(0.1 * 2 ** (rungs / 2))


@pytest.mark.parametrize("config,bound,top", [
    ({}, 0.15, 0.1 * 2**0.5),  # the defaults: the view's first rung is the top of its ladder
    ({"keep_ratio": 0.01}, 0.15, 0.08 * 2**0.5),  # climbs to 0.113; 0.16 would pass 0.15
    ({"keep_ratio": 0.25}, 0.25, 0.25),  # the bound is never below the keep ratio
    ({"view_max_keep": 0.3}, 0.3, 0.2 * 2**0.5),
    ({"view_max_keep": 0}, 0.0, 0.4),  # no bound: the ladder up to the cap, then full KV
    ({"host_copies": "off"}, 0.0, 0.4),  # the view is the span later questions share
])
def test_the_view_is_bounded_only_with_host_copies(config, bound, top):
    controller = controller_for(config, Tree())
    assert controller.config.view_max_keep == pytest.approx(bound)
    assert controller.method.keep.bounded == (bound > 0)
    assert controller.method.keep.top() == pytest.approx(top)


def test_the_view_bound_flag_is_validated_in_one_line():
    assert build_config(True, None, {}).view_max_keep is None  # resolved by the server: 0.15
    assert build_config(True, None, {"view_max_keep": "0"}).view_max_keep == 0.0
    assert build_config(True, None, {"view_max_keep": "0.2"}).view_max_keep == 0.2
    with pytest.raises(UniCacheFlagError, match="--unicache-view-max-keep: .*view_max_keep"):
        build_config(True, None, {"view_max_keep": "1.5"})
    with pytest.raises(UniCacheFlagError, match="--unicache-view-max-keep: .*>= keep_ratio"):
        build_config(True, None, {"view_max_keep": "0.05"})
