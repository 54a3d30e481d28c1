"""The radix cache ``--unicache`` selects: SGLang's UnifiedRadixCache, aware of compressed spans.

Registered as radix-cache backend ``unicache`` (``sglang.srt.mem_cache.registry``) and chosen
automatically with ``--unicache``. It differs from the default cache in four ways:

- It runs the Python tree core (``SpanTreeCore``), whose nodes carry each compressed span's
  metadata (``spans.SpanMeta``) in the Full component's node metadata, and which refuses to split
  a node inside a compressed span (the split would hand a later request part of a selection).
- It owns every cached span's metadata: after a request's KV enters the tree, the spans the
  request compressed itself (``RequestState.fresh``) are attached to the node holding them and
  indexed by image (``spans``) for later requests; an entry dies with its node.
- Under memory pressure, a leaf that ends in a compressed span is re-compressed before it is
  evicted: each layer and head keeps its highest-priority entries (protected ones first,
  ``shrink.py``; in a paged pool as many as end the span on a page boundary), the node's key and
  slots shrink in place, the rest of the slots go back to the allocator. Only a span at its
  floor is evicted whole. A shrink counts as a touch: the shrunk leaf goes behind every other
  leaf of the eviction walk, so every cached image is halved once before any is halved twice,
  and one walk goes on until it has freed what it was asked for.

- At rest, with host copies (``recall.py``): a span its request's self-check escalated goes back
  to the keep ratio's entries once no request uses it (``on_release``, ``KeepRatio.at_rest``),
  in place, keeping the text after it and the nodes below: the host copy serves later questions,
  the span their prefix match and the chat's history.

A request using a span locks its node, so a span is never re-compressed under a running request.

With host copies (``recall.py``) it also takes the loads of recalled images: ``init_load_back``
fills slots the request owns (``load_back_is_cache_owned`` False for that load), and
``prefix_device_indices`` appends them to the request's device prefix.

With HiCache (``--enable-hierarchical-cache``) a span node is backed up to host memory like any
node; under pressure a backed-up leaf is demoted (its device slots freed, the exact host copy
kept) rather than re-compressed, so the host copy is never stale, and a later request about the
image loads it back (``init_load_back``). Its metadata stays with the host-only node
(``SpanTreeCore`` reports every move) and dies only when the host tier evicts the node.

The scheduler side (``controller.py``) talks to it through a narrow protocol: it configures it
once (``enable_spans`` with ``SpanSettings``), looks spans up by image (``spans.id_choices``) and
reads counters (``held``, ``recompressed``); the cache reads nothing of the controller.
"""

from __future__ import annotations

import heapq
import logging
from array import array
from dataclasses import dataclass, replace

import torch
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.registry import (
    TreeCacheBuildContext,
    create_unified_radix_cache,
    default_radix_cache_factory,
    get_radix_cache_factory,
    register_radix_cache_backend,
)
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_cache.components.base import get_and_increase_time_counter
from sglang.srt.mem_cache.unified_cache.tree_core_registry import (
    get_tree_core_factory,
    register_tree_core_backend,
)
from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeCore
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from sglang_unicache.engine.flags import config_of
from sglang_unicache.engine.host_pool import quantize_host_copies
from sglang_unicache.engine.kvpool import Slots, move_entries, pool_buffers
from sglang_unicache.engine.request import state_of
from sglang_unicache.engine.spans import SpanIndex, SpanMeta, SpanNaming
from sglang_unicache.policy.catalog import from_config
from sglang_unicache.policy.inputs import page_end
from sglang_unicache.policy.keep import KeepRatio
from sglang_unicache.policy.quantize import bits_of
from sglang_unicache.policy.shrink import shrink_order

logger = logging.getLogger("sglang_unicache")

BACKEND = "unicache"
META = "unicache_spans"  # node.component(FULL).metadata[META]: {first id: SpanMeta}
FULL = ComponentType.FULL


class SplitInsideSpanError(AssertionError):
    pass


def spans_of(node) -> dict[int, SpanMeta]:
    return node.component(FULL).metadata.get(META, {})


def _span_offsets(node) -> list[tuple[int, SpanMeta]]:
    """(offset in the node's key, meta) of every span the node holds, in key order."""
    spans = spans_of(node)
    if not spans:
        return []
    ids = node.key.raw_token_ids()
    found = []
    for at, token in enumerate(ids):
        meta = spans.get(token)
        if meta is not None:
            found.append((at, meta))
    return found


def _device_spans(node) -> list[SpanMeta]:
    """The spans a node holds in device slots now (none while it is evicted or host-only)."""
    if node.component(FULL).value is None:
        return []
    return list(spans_of(node).values())


class SpanTreeCore(UnifiedTreeCore):
    """The Python tree core, keeping span metadata with the node that holds the span.

    Every change of where a span node's KV lives goes through four methods of the core, which
    report it to ``owner`` (the radix cache, once ``enable_spans`` ran):

    - the device copy freed by demotion to HiCache's host tier (``_cascade_evict``, which
      clears the node's device value);
    - the device copy back, by a load from the host tier (``commit_load_back``) or an insert
      over a host-only node (``_unevict_node_on_insert``);
    - the node leaving the tree (``_unregister_node``): its metadata and index entry go with it,
      and its device slots, which a deleted leaf's value still names, stop counting.

    A host-only node keeps its metadata, so a later request still finds the span and loads it
    back.
    """

    owner = None

    def _cascade_evict(self, node, *args, **kwargs):
        before = _device_spans(node)
        result = super()._cascade_evict(node, *args, **kwargs)
        if before and self.owner is not None and node.component(FULL).value is None:
            self.owner.spans_left_device(node, before)
        return result

    def commit_load_back(self, node_id, device_indices, kv_xfer, comp_xfers):
        nodes = [self.node_by_id(n) for n in kv_xfer.nodes_to_load or ()]
        off = [node for node in nodes if node.component(FULL).value is None]
        actions = super().commit_load_back(node_id, device_indices, kv_xfer, comp_xfers)
        if self.owner is not None:
            for node in off:
                self.owner.spans_entered_device(node, loaded=True)
        return actions

    def _unevict_node_on_insert(self, node, fresh_value, session_id=None):
        super()._unevict_node_on_insert(node, fresh_value, session_id)
        if self.owner is not None:
            self.owner.spans_entered_device(node, loaded=False)

    def _unregister_node(self, node):
        super()._unregister_node(node)
        if self.owner is not None and spans_of(node):
            self.owner.spans_removed(node)

    def _split_node(self, key, child, split_len):
        found = _span_offsets(child)
        for at, meta in found:
            if at < split_len < at + meta.count:
                raise SplitInsideSpanError(f"radix split at {split_len} inside a compressed "
                                           f"span at {at}..{at + meta.count}")
        child.component(FULL).metadata.pop(META, None)
        new_node, action = super()._split_node(key, child, split_len)
        for at, meta in found:
            owner = new_node if at < split_len else child
            owner.component(FULL).metadata.setdefault(META, {})[meta.ids[0]] = meta
        return new_node, action


def _tree_core_factory(params, components):
    return SpanTreeCore(params, components)


@dataclass(frozen=True)
class SpanSettings:
    """What the cache needs to know of the config: span ids, and re-compression under pressure."""

    naming: SpanNaming
    recompress: bool
    keep: KeepRatio  # how far a re-compression shrinks a span
    rest_at_keep_ratio: bool = True  # escalated spans with a host copy shrink once unused

    @classmethod
    def of(cls, config) -> SpanSettings:
        return cls(SpanNaming.of(config), config.recompress, from_config(KeepRatio, config),
                   config.rest_at_keep_ratio)


@dataclass
class Recompressed:
    spans: int = 0  # shrinks under memory pressure
    slots_freed: int = 0  # by both kinds of shrink
    at_rest: int = 0  # escalated spans back at the keep ratio once unused


@dataclass
class HostTier:
    """Compressed spans in HiCache's host tier (``--enable-hierarchical-cache``)."""

    spans: int = 0  # held only in host memory now
    loaded_back: int = 0  # loaded onto the device for a later request
    load_back_waits: int = 0  # rounds a request waited for room to load its spans


class CompressedRadixCache(UnifiedRadixCache):
    settings: SpanSettings | None = None  # None until ``enable_spans``: a plain radix cache
    slots: Slots
    spans: SpanIndex
    held = 0  # slots the attached compressed spans hold (kept as they change: read per round)
    recompressed: Recompressed
    host: HostTier
    recall = None  # recall.Recall with host copies on
    private_load = False  # the last ``init_load_back`` filled slots of the request's own
    # Escalated spans with a host copy, shrunk at rest once no request uses them (``_rest``).
    resting: dict[int, tuple[object, SpanMeta]]

    def enable_spans(self, settings: SpanSettings, slots: Slots, recall=None) -> None:
        """Compressed spans from now on: ids and re-compression by ``settings``, the slots a
        re-compression drops freed through ``slots`` (the plugin's one free path), recalled
        images loaded by ``recall``."""
        self.settings = settings
        self.recall = recall
        self.slots = slots
        self.spans = SpanIndex()
        self.recompressed = Recompressed()
        self.host = HostTier()
        self.resting = {}
        self.tree_core.owner = self

    # -- where a span's KV lives (reported by ``SpanTreeCore``) ------------------------------------
    def spans_left_device(self, node, metas: list[SpanMeta]) -> None:
        """Node ``node`` lost its device copy of ``metas``; it is host-only if backed up."""
        self.held -= sum(meta.count for meta in metas)
        if node.backuped:
            self.host.spans += len(metas)

    def spans_entered_device(self, node, *, loaded: bool) -> None:
        """Host-only node ``node`` has a device copy again (``loaded``: from the host tier)."""
        metas = _device_spans(node)
        self.held += sum(meta.count for meta in metas)
        self.host.spans -= len(metas)
        if loaded:
            self.host.loaded_back += len(metas)

    def spans_removed(self, node) -> None:
        """A node left the tree: its spans die with it, from the device or from the host."""
        metas = list(spans_of(node).values())
        if node.component(FULL).value is not None:
            self.held -= sum(meta.count for meta in metas)
        else:
            self.host.spans -= len(metas)
        for meta in metas:
            self.spans.discard(meta)
            self.resting.pop(id(meta), None)

    def count_on_host(self) -> int:
        """``host.spans`` recounted from every node (what ``check_integrity`` compares it with)."""
        return sum(len(spans_of(node)) for node in self.tree_core._node_arena.values()
                   if node.component(FULL).value is None and node.backuped)

    def init_load_back(self, params):
        """HiCache's load of a host hit onto the device, for a request whose ids name
        compressed spans in the host part of its match: such a request cannot fall back to
        prefilling those tokens (they are ids of kept entries, not of the image), so the load
        is not skipped for being small (SGLang's ``load_back_threshold``), and when it fails
        (no room yet) the request waits in the queue, as for memory (``host.load_back_waits``),
        instead of being admitted without it."""
        req = params.req
        self.private_load = False
        if self.recall is not None and req is not None:
            loaded = self.recall.load(self, req, params.host_hit_length)
            if loaded is not None:
                self.private_load = loaded[0] > 0
                return loaded
        if self.settings is None or params.host_hit_length <= 0 or req is None \
                or not self._host_spans(params.best_match_node, req.last_node):
            return super().init_load_back(params)
        threshold, self.load_back_threshold = self.load_back_threshold, 1
        try:
            loaded = super().init_load_back(params)
        finally:
            self.load_back_threshold = threshold
        if loaded is not None and loaded[0] == 0:
            self.host.load_back_waits += 1
            return None
        return loaded

    def load_back_is_cache_owned(self) -> bool:
        return not self.private_load and super().load_back_is_cache_owned()

    def prefix_device_indices(self, req):
        """The request's device prefix; for a recall, the tree's text before the image, then the
        slots its load filled."""
        tail = self.recall.take_tail(req.rid) if self.recall is not None else None
        if tail is None:
            return super().prefix_device_indices(req)
        path = self.tree_core.collect_full_device_indices(req.last_node,
                                                          self.root_node_handle(req.extra_key))
        start = req.prefix_len - tail.numel()
        return torch.cat([path[:start], tail.to(device=path.device, dtype=path.dtype)])

    def evict_for(self, tokens: int) -> None:
        """Make room for ``tokens`` slots, as an allocation of SGLang's does."""
        from sglang.srt.mem_cache.allocation import evict_from_tree_cache

        evict_from_tree_cache(self, tokens)

    def _host_spans(self, best_node_id, device_node_id) -> bool:
        """Whether a node between the match's last device node and its best node holds spans."""
        node = self.tree_core.node_by_id(best_node_id)
        while node is not None and node.parent is not None and node.id != device_node_id:
            if spans_of(node):
                return True
            node = node.parent
        return False

    def checkpoint_into_tree(self, req, *, up_to: int, **kwargs) -> None:
        super().checkpoint_into_tree(req, up_to=up_to, **kwargs)
        if self.settings is not None:
            self._attach_fresh(req)

    def _attach_fresh(self, req) -> None:
        """The request's KV is in the tree: index the spans it compressed itself and attach their
        metadata to the node holding each (unless the tree already held the same span, from a
        request that compressed the same image first: that one's metadata stays)."""
        metas = state_of(req).take_fresh()
        if not metas:
            return
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        for at, meta in metas:
            if not torch.equal(row[at:at + meta.count], meta.slots):
                continue  # deduplicated against the tree's copy of this span
            meta.slots = None
            node = self.node_holding(req.last_node, meta.ids[0])
            if node is not None:
                self.attach(node, meta)
                self.spans.add(meta)
                if self._rest_count(meta) < meta.count:
                    self.resting[id(meta)] = (node, meta)

    def _rest_count(self, meta: SpanMeta) -> int:
        """The entries span ``meta`` keeps at rest: the keep ratio's count when its check
        escalated it and its image has a host copy (``KeepRatio.at_rest``), else its own."""
        keep = self.settings.keep
        if (not self.settings.rest_at_keep_ratio or meta.keep_ratio <= keep.keep_ratio
                or self.recall is None or not self.recall.holds(meta.host)):
            return meta.count
        return keep.at_rest(meta.count, meta.length)

    def on_release(self, req, *, checkpointed: bool) -> None:
        super().on_release(req, checkpointed=checkpointed)
        if self.settings is not None and self.resting:
            self._rest()

    def _rest(self) -> None:
        """Shrink every escalated span waiting for rest whose node no request uses now (a
        node's lock counts the requests on it and below it) to its rest count, keeping the text
        after it (the chat's history) and its children. A span whose copy is gone keeps its
        count: it is what a later question reuses then."""
        for key, (node, meta) in list(self.resting.items()):
            node = _restable(node, meta)
            if node is not None and node.component(FULL).lock_ref > 0:
                continue  # in use: wait for its release
            del self.resting[key]
            if node is None:
                continue
            at = list(node.key.raw_token_ids()).index(meta.ids[0])
            k_new = page_end(at + self._rest_count(meta), self.page_size) - at
            if k_new < meta.count and self._shrink(node, at, meta, k_new, keep_tail=True):
                self.recompressed.at_rest += 1

    def resting_unused(self) -> int:
        """Spans still waiting to rest whose node is on the device and used by no request
        (``_rest`` should have shrunk them at the last release; ``check_integrity``)."""
        nodes = [_restable(node, meta) for node, meta in self.resting.values()]
        return sum(1 for node in nodes if node is not None and node.component(FULL).lock_ref == 0)

    def node_holding(self, last_node_id, first_id: int):
        """The node on the path from the root to node ``last_node_id`` whose key holds
        ``first_id`` (None if none does)."""
        node = self.tree_core.node_by_id(last_node_id)
        while node is not None and node.parent is not None:
            if first_id in node.key.raw_token_ids():
                return node
            node = node.parent
        return None

    def spans_at(self, node_id) -> dict[int, SpanMeta]:
        """The compressed spans node ``node_id`` holds, by first id."""
        return dict(spans_of(self.tree_core.node_by_id(node_id)))

    def compressed_slots_held(self) -> int:
        """Slots the tree's compressed spans hold on the device now (O(1), see ``held``)."""
        return self.held

    def count_held(self) -> int:
        """``held`` recounted from every node (what ``check_integrity`` compares it with)."""
        return sum(meta.count for node in self.tree_core._node_arena.values()
                   if node.component(FULL).value is not None
                   for meta in spans_of(node).values())

    def attach(self, node, meta: SpanMeta) -> None:
        spans = node.component(FULL).metadata.setdefault(META, {})
        old = spans.get(meta.ids[0])
        self.held += meta.count - (old.count if old is not None else 0)
        spans[meta.ids[0]] = meta

    def reset(self) -> None:
        super().reset()
        self.held = 0
        if self.settings is not None:
            self.spans.clear()
            self.resting.clear()
            self.host.spans = 0
        if self.recall is not None:
            self.recall.clear()

    def _evict_device_leaf(self, node_id, tracker):
        if self.settings is not None and self.settings.recompress:
            node = self.tree_core.node_by_id(node_id)
            freed = self._shrink_leaf(node)
            if freed:
                tracker[FULL] = tracker.get(FULL, 0) + freed
                self._requeue(node)
                return None
        return super()._evict_device_leaf(node_id, tracker)  # the tree core reports the spans

    def _requeue(self, node) -> None:
        """A shrunk leaf is still a leaf: it goes back into the running eviction walk (or the
        walk could end with space still owed, and the allocation after it fail), behind every
        other leaf, since a shrink counts as a touch (fair re-compression: every cached image is
        halved once before any is halved twice)."""
        now = get_and_increase_time_counter()
        walk = node
        while walk is not None:  # as a prefix match touches a path: the leaf newest
            walk.last_access_time = now
            now -= 0.00001
            walk = walk.parent
        full = self.tree_core.components_by_type[FULL]
        if full.is_evict_device_ongoing:
            heapq.heappush(full._evict_device_heap,
                           (full.session_ref_eviction_strategy(node), node))

    def _shrink_leaf(self, node) -> int:
        """Re-compress the last span of an unlocked device leaf in place, dropping the text
        after it; slots freed (0: not possible, the caller evicts the leaf)."""
        found = _span_offsets(node)
        cd = node.component(FULL)
        if not found or cd.value is None or node.backuped or node.key.is_bigram:
            return 0
        at, meta = found[-1]
        # Paged: the span still ends on a page boundary (the node's key starts one), so whole
        # pages are freed and a later question after it starts its own page.
        k_new = page_end(at + self.settings.keep.shrunk(meta.count, meta.length),
                         self.page_size) - at
        if k_new >= meta.count:
            return 0
        freed = self._shrink(node, at, meta, k_new, keep_tail=False)
        if freed:
            self.recompressed.spans += 1
            logger.debug("sglang-unicache: re-compressed span to %d entries under pressure",
                         k_new)
        return freed

    def _shrink(self, node, at: int, meta: SpanMeta, k_new: int, *, keep_tail: bool) -> int:
        """Keep the top ``k_new`` entries of span ``meta`` at offset ``at`` of unlocked device
        node ``node`` (``shrink.shrink_order``), under the ids of that count; the text after the
        span stays in the node with ``keep_tail`` (its KV does not depend on the span's count),
        else it is freed too (a leaf only). Slots freed; 0 when the new key would collide with
        a sibling's."""
        if node.key.is_bigram:
            return 0
        cd = node.component(FULL)
        new_ids = self.settings.naming.ids(meta.pad, meta.start, k_new, meta.variant)
        ids = list(node.key.raw_token_ids())
        tail = ids[at + meta.count:] if keep_tail else []
        key = RadixKey(array("q", ids[:at] + list(new_ids) + tail),
                       node.key.extra_key, cache_salt=node.key.cache_salt)
        # The parent finds the node by its key's first page (first token at page size 1):
        # a span starting there re-keys the node.
        old_child_key, child_key = (node.key.child_key(self.page_size),
                                    key.child_key(self.page_size))
        if child_key != old_child_key:
            sibling = node.parent.children.get(child_key)
            if sibling is not None and sibling is not node:
                # The same image at the smaller budget is already a sibling (another request
                # compressed it with that K, or AirCache's K differed): drop this copy instead
                # of re-keying it onto the sibling's key.
                return 0
        keep = shrink_order(meta.priority, k_new)
        value = cd.value
        slots = value[at:at + meta.count]
        move_entries(*pool_buffers(self.token_to_kv_pool_allocator.get_kvcache()), slots, keep)
        rest = value[at + meta.count:]
        freed = slots[k_new:] if keep_tail else torch.cat([slots[k_new:], rest])

        old_first, old_count = meta.ids[0], meta.count
        meta.shrink(keep, new_ids)
        node.key = key
        if child_key != old_child_key:
            node.parent.children.pop(old_child_key)
            node.parent.children[child_key] = node
        cd.value = torch.cat([value[:at], slots[:k_new], *([rest] if keep_tail else [])])
        spans = spans_of(node)
        spans.pop(old_first)
        spans[meta.ids[0]] = meta
        self.spans.changed()
        _forget_hashes(node)
        self.tree_core.component_evictable_size_[FULL] -= freed.numel()
        self.held -= old_count - k_new
        self.slots.free(freed)
        self.recompressed.slots_freed += freed.numel()
        return freed.numel()


def _restable(node, meta: SpanMeta):
    """The node holding ``meta`` now (``node``, or the ancestor a split moved it to: a split
    puts the new node above the one it splits), if the span can still rest there; None once it
    left the tree, was evicted or demoted, or HiCache backed it up (that copy must stay exact)."""
    while node is not None and spans_of(node).get(meta.ids[0]) is not meta:
        node = node.parent
    if node is None or node.component(FULL).value is None or node.backuped:
        return None
    return node


def _forget_hashes(node) -> None:
    """A node's key changed: its page hashes, and those chained from them below it, are stale
    (recomputed when next needed)."""
    stack = [node]
    while stack:
        walk = stack.pop()
        walk.hash_value = None
        stack.extend(walk.children.values())


def _factory(ctx: TreeCacheBuildContext):
    if ctx.disable_radix_cache or ctx.is_hybrid_swa or ctx.is_hybrid_ssm:
        return default_radix_cache_factory(ctx)
    ctx = replace(ctx, params=replace(ctx.params, tree_core_backend=BACKEND))
    config = config_of(ctx.server_args)
    if ctx.enable_hierarchical_cache and config is not None \
            and config.host_quantization != "off":
        quantize_host_copies(bits_of(config.host_quantization))
    return create_unified_radix_cache(ctx, cache_class=CompressedRadixCache)


def register() -> None:
    """Register the tree core and the radix cache backend (once per process)."""
    if get_tree_core_factory(BACKEND) is None:
        register_tree_core_backend(BACKEND, _tree_core_factory)
    if get_radix_cache_factory(BACKEND) is None:
        register_radix_cache_backend(BACKEND, _factory)
