"""Recall: a later question about an image is prefilled over the image's full KV, loaded back
from its host copy (``host_copies.py``), and then compresses its own view of it.

Three steps, each at a point SGLang already has:

1. **Copy** (after a request's prefill, before its compaction, ``compress.py``): the full KV of the
   request's first image, when it is compressed, is packed into the host store. Only the first
   image: a copy is keyed by the prompt before it, and a later image's KV also depends on the
   earlier image as this request saw it (possibly compressed).
2. **Decide** (match time, after ``reuse.py``'s device decision): a waiting request whose first
   image has a host copy, and whose text before the image the tree holds on the device, is
   planned for recall. Its ids stay as the user sent them. Its prefix becomes the tree's text
   before the image, the image from the host, and the history: the turns after the image that
   the device path held behind a compressed copy of it (an earlier turn of the same chat, say),
   copied from those slots. The device path names the history (compressed ids), the host path
   supplies the image (full ids); the history's KV is the same in both, at the same positions.
   In a paged pool the prefix ends at the image's first page instead, and the load starts there:
   the text before the image on that page (``lead``) is copied from the device path too. The
   load takes whole pages; the prefill goes on in its last one.
   The plan is handed to SGLang's admission as a host hit of N + h tokens, so admission budgets
   it and calls ``init_load_back`` as for a HiCache load.
3. **Load** (admission, ``init_load_back``): N + h slots are allocated and filled, owned by the
   request (SGLang's request-owned load, the protocol of its external KV linker:
   ``load_back_is_cache_owned`` is False, so ``cache_protected_len`` stays at the text before the
   image, and ``prefix_device_indices`` appends the loaded slots). The prefill computes only the
   new tokens, over every image token; the image is past the request's protected prefix, so the
   request's own compression (``targets.py``, ``compress.py``) compresses it with this
   question's observation window and frees N - K slots, as for a first request.

At rest (``keep_recalled_views`` off, the default) a recalled request with one image does not
enter the tree: SGLang's ``skip_radix_cache_insert`` frees its view, question and answer when it
finishes, so the device holds one compressed span per image (the first question's, with that
chat's history) and the host its full copy. A later turn of a recalled chat recalls again and
prefills the turns after the first one. A request with later images (an agent's next
screenshot) enters the tree as usual, so those images are compressed once and reused; and a
request whose device match already reuses a later image is not recalled (recalling would
prefill those images again at every step).

If the copy or the room is gone by admission, the load reports 0 tokens and SGLang admits the
request with its device prefix only: the image is encoded and prefilled again, then compressed.
Nothing is allocated before admission, so an abort or retraction of a waiting request has
nothing to free; after admission the loaded slots are the request's, freed like its own KV.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from sglang_unicache.engine.host_copies import HostCopies, HostKey, host_key
from sglang_unicache.engine.kvpool import copy_slots, pool_buffers, read_entries, write_entries
from sglang_unicache.engine.request import existing_state, namespace, state_of
from sglang_unicache.engine.rewrite import restore
from sglang_unicache.engine.stats import Stats
from sglang_unicache.engine.targets import Targets
from sglang_unicache.policy.inputs import page_end

logger = logging.getLogger("sglang_unicache")


@dataclass(frozen=True)
class RecallPlan:
    """A waiting request's recall, decided at match time."""

    key: HostKey
    start: int  # the image's first position
    length: int  # N
    history: int  # h: tokens after the image copied from the device path
    source: object  # the node the device match ended at (locked through admission)
    source_from: int  # where the history starts on that node's path
    lead: int = 0  # paged pool: the text before the image on its first page, copied too

    @property
    def prefix(self) -> int:
        """Where the device prefix ends and the load starts (a page boundary)."""
        return self.start - self.lead

    @property
    def tokens(self) -> int:
        return self.lead + self.length + self.history


@dataclass
class PendingCopy:
    key: HostKey
    keys: list[torch.Tensor] | None  # None: the store holds this image's copy already
    values: list[torch.Tensor] | None


@dataclass
class Recall:
    copies: HostCopies
    targets: Targets
    kv_pool: object
    stats: Stats
    keep_views: bool = False  # a recalled request's view enters the tree when it finishes
    page_size: int = 1  # the pool's ``--page-size``: a load is whole pages
    tails: dict[str, torch.Tensor] = field(default_factory=dict)  # rid -> loaded, not yet in a row

    # -- 1. copy ----------------------------------------------------------------------------------
    def take(self, req, starts: list[int], row: torch.Tensor) -> PendingCopy | None:
        """The packed full KV of the request's first image if it is among the spans starting at
        ``starts`` (about to be compressed), or only its key if the store holds its copy already
        (a recalled question's own view); read only: ``keep`` stores it once the compression
        holds."""
        state = state_of(req)
        mine = self.targets.image_spans(req)
        if state.rewrites or not mine or mine[0][0] not in starts:
            return None
        start, end, pad = mine[0]
        key = host_key(namespace(req), pad, start, end - start, req.origin_input_ids)
        if self.copies.get(key) is not None:
            return PendingCopy(key, None, None)
        index = row[start:end].to(torch.int64)
        k_buffers, v_buffers = pool_buffers(self.kv_pool)
        return PendingCopy(key, self.copies.pack([read_entries(b, index) for b in k_buffers]),
                           self.copies.pack([read_entries(b, index) for b in v_buffers]))

    def keep(self, pending: PendingCopy | None) -> HostKey | None:
        """Store a copy ``take`` packed once its compression holds. The key of the image's copy
        when the store holds one now (stored, or there already), else None (no first image, or
        a copy over the byte budget)."""
        if pending is None:
            return None
        if pending.keys is None:
            return pending.key if self.holds(pending.key) else None
        return pending.key if self.copies.put(pending.key, pending.keys, pending.values) else None

    def holds(self, key) -> bool:
        """Whether the copy keyed ``key`` (None: no copy) is in the store (not marked used)."""
        return key in self.copies

    # -- 2. decide --------------------------------------------------------------------------------
    def decide(self, req) -> bool:
        """After the device decision's match: plan the request's recall, if it has one (True)."""
        state = state_of(req)
        state.recall = None
        if state.private:  # decided again (a retraction): the new decision says
            req.skip_radix_cache_insert, state.private = False, False
        if req.host_hit_length > 0 or not len(self.copies):
            return False
        plan = self._plan(req, state)
        if plan is None:
            return False
        for record in reversed(state.rewrites):
            restore(req, record)
        state.rewrites = []
        state.reused = 0
        state.recall = plan
        req.prefix_len = plan.prefix
        req.kv.cache_protected_len = plan.prefix
        req.host_hit_length = plan.tokens
        req.best_match_node = req.last_node
        req.num_matched_prefix_tokens = plan.prefix + plan.tokens
        return True

    def _plan(self, req, state) -> RecallPlan | None:
        record = state.rewrites[0] if state.rewrites else None
        # In the ids the user sent (a compressed span may be below min_image_tokens).
        spans = self.targets.image_spans(req, record.offsets if record is not None else None)
        if not spans:
            return None
        start, end, pad = spans[0]
        if record is not None and any(s.start != start for s in record.spans):
            # The device path also serves later images (an agent's earlier screenshots): a
            # recall would undo those reuses and prefill them again, every step.
            return None
        span = next((s for s in record.spans if s.start == start), None) if record else None
        ids = record.origin_input_ids if record is not None else req.origin_input_ids
        kept = len(span.ids) if span is not None else 0
        key = host_key(namespace(req), pad, start, end - start, ids)
        if key not in self.copies:
            return None
        matched = req.prefix_len
        if span is None:
            if matched != start:  # past it: the tree holds the image itself; short: not its text
                return None
            history = 0
        else:
            history = matched - (start + kept)
            if len(spans) > 1:  # the history stops before the request's next image
                history = min(history, spans[1][0] - end)
        # One prompt token is always computed (SGLang matches at most the prompt's length - 1).
        history = min(history, len(ids) - 1 - end)
        if history < 0:
            return None
        # A paged pool's prefix ends on a page boundary: the load starts at the image's first
        # page, its text before the image copied from the device path (which holds it only in
        # front of a compressed copy).
        lead = start % self.page_size
        if lead and span is None:
            return None
        return RecallPlan(key, start, end - start, history, req.last_node, start + kept, lead)

    # -- 3. load ----------------------------------------------------------------------------------
    def load(self, tree, req, host_hit_length: int) -> tuple[int, object] | None:
        """``init_load_back`` for a planned recall: (tokens loaded, node to lock); None when the
        request has no recall planned (a HiCache load)."""
        state = existing_state(req)
        plan = state.recall if state is not None else None
        if plan is None or host_hit_length != plan.tokens:
            return None
        state.recall = None
        copy = self.copies.get(plan.key)
        slots = None
        if copy is not None:
            # Whole pages; the prefill goes on in the last one (SGLang's extend fills a
            # request's partial page from its last slot on).
            pages = page_end(plan.tokens, self.page_size)
            tree.evict_for(pages)
            slots = tree.token_to_kv_pool_allocator.alloc(pages)
        if slots is None:
            self.stats.recall_lost += 1
            return 0, req.last_node  # prefilled instead
        slots = slots[:plan.tokens]
        k_buffers, v_buffers = pool_buffers(self.kv_pool)
        device = k_buffers[0].device
        slots = slots.to(torch.int64)
        lead, image, history = slots.split([plan.lead, plan.length, plan.history])
        write_entries(k_buffers, v_buffers, image,
                      [self.copies.unpack(t, device) for t in copy.keys],
                      [self.copies.unpack(t, device) for t in copy.values])
        if plan.lead or plan.history:
            path = tree.path_device_indices(plan.source).to(torch.int64)
            copy_slots(k_buffers, v_buffers,
                       torch.cat([path[plan.prefix:plan.start],
                                  path[plan.source_from:plan.source_from + plan.history]]),
                       torch.cat([lead, history]))
        self.tails[req.rid] = slots
        alone = len(self.targets.image_spans(req)) == 1  # later images must enter the tree
        if alone and not self.keep_views and not req.skip_radix_cache_insert:
            req.skip_radix_cache_insert, state.private = True, True
        self.stats.spans_recalled += 1
        self.stats.recall_history_tokens += plan.history
        self.stats.recall_bytes += copy.nbytes
        return plan.tokens, req.last_node

    def take_tail(self, rid: str) -> torch.Tensor | None:
        """The slots loaded for request ``rid``, once (its row takes them)."""
        return self.tails.pop(rid, None)

    def clear(self) -> None:
        """The cache was flushed: every copy goes (the allocator took every slot back)."""
        self.tails.clear()
        self.copies.clear()

    def check(self) -> list[str]:
        errors = self.copies.check()
        if self.tails:
            errors.append(f"{len(self.tails)} recalled span(s) loaded but in no request's row")
        return errors

    def gauges(self) -> dict[str, float]:
        return {"host_copies": len(self.copies), "host_copy_bytes": self.copies.nbytes}

    def counters(self) -> dict[str, float]:
        return {"host_copies_stored": self.copies.counters.stored,
                "host_copies_evicted": self.copies.counters.evicted}

