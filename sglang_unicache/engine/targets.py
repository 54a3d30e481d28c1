"""Which requests of an extend batch compress which images: decided once, before it runs.

A request whose prompt ends in this extend and that brings image spans (>= ``min_image_tokens``)
past the prefix it took from the tree is a target; its last W prompt positions are marked for
query capture (``capture.py``). With chunked prefill, the middle chunks of such a request are
kept out of the tree (``defer_chunk_checkpoint``), so the whole prompt is compressed at its last
chunk. Images the tree supplied (compressed spans reused, or an uncompressed copy) are shared
and stay as they are; a later chat turn or agent step still compresses the new images it brings.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from sglang_unicache.engine.capture import CaptureTarget, QueryCapture
from sglang_unicache.engine.request import full_kv_only, merge_runs
from sglang_unicache.engine.stats import Stats
from sglang_unicache.policy.config import UniCacheConfig

logger = logging.getLogger("sglang_unicache")

Span = tuple[int, int, int]  # (start, end, image pad id), end exclusive, in the request's ids


@dataclass
class Pending:
    """A target of the extend batch in flight: its batch (None once it is parked: it is
    compressed out of every batch, ``parking.py``), its capture rows, its spans."""

    batch: object
    target: CaptureTarget
    spans: list[Span]


@dataclass
class Targets:
    config: UniCacheConfig
    stats: Stats
    active: bool = True  # a method that compresses at a keep ratio below 1
    pending: dict[str, Pending] = field(default_factory=dict)  # rid -> its targets (this batch)
    capture: QueryCapture | None = None  # the observation queries of this batch's targets
    deferred: set[str] = field(default_factory=set)  # rids whose checkpoint waits (this batch)
    multi_run_noted: bool = False  # the one log line about items in several runs was written

    def image_spans(self, req, offsets: list | None = None) -> list[Span]:
        """The request's image and video spans of at least ``min_image_tokens``, in its ids (or
        in the ids ``offsets`` describe: each item's runs, e.g. before a rewrite)."""
        mm = req.multimodal_inputs
        if mm is None:
            return []
        spans = []
        for i, item in enumerate(mm.mm_items):
            if item.modality.name not in ("IMAGE", "MULTI_IMAGES", "VIDEO"):
                continue
            runs = merge_runs((item.offsets if offsets is None else offsets[i]) or [])
            if len(runs) > 1:
                # SGLang slices an item's embeddings by summing its runs' lengths in the ids
                # (``mm_schedule``): once one run became K ids, a later run of the same item
                # still prefilled would get a shifted slice. Such items keep their full KV.
                self._note_multi_run(len(runs))
                continue
            for start, end in runs:
                if end - start >= self.config.min_image_tokens:
                    spans.append((start, end, int(item.pad_value or 0)))
        return sorted(spans)

    def _note_multi_run(self, runs: int) -> None:
        if not self.multi_run_noted:
            self.multi_run_noted = True
            logger.info("sglang-unicache: an image or video item in %d separate token runs is "
                        "served on its full KV (items of one run are compressed)", runs)

    def begin_forward(self, batch) -> QueryCapture | None:
        """Everything decided about an extend batch, once, before it runs: which requests are
        targets (and their spans and observation rows), which middle chunks keep their KV out of
        the tree until their last chunk, and how many images the prefill computes."""
        self.pending.clear()
        self.deferred.clear()
        self.capture = None
        for req, extend_len in zip(batch.reqs, batch.extend_lens, strict=True):
            first = req.extend_end - extend_len
            self.stats.images_prefilled += sum(
                first <= start < req.extend_end for start, _, _ in self.image_spans(req))
        if not self.active or batch.decoding_reqs:
            return None
        targets, spans_of = [], {}
        offset = 0
        for i, (req, extend_len) in enumerate(zip(batch.reqs, batch.extend_lens, strict=True)):
            start_row, offset = offset, offset + extend_len
            if req.extend_end != len(req.full_untruncated_fill_ids):
                # A middle chunk: compress when the prompt is complete.
                if self._own_spans(req)[0]:
                    self.deferred.add(req.rid)
                continue
            spans = self.new_image_spans(req)
            if not spans:
                continue
            w = min(self.config.observation_window, extend_len)
            targets.append(CaptureTarget(
                req.rid, i, range(start_row + extend_len - w, start_row + extend_len),
                range(req.extend_end - w, req.extend_end)))
            spans_of[req.rid] = spans
        if not targets:
            return None
        self.capture = QueryCapture.for_targets(targets, device=batch.seq_lens.device)
        self.pending = {t.rid: Pending(batch, t, spans_of[t.rid]) for t in targets}
        return self.capture

    def new_image_spans(self, req) -> list[Span]:
        """The request's images that this prefill computes (in its current ids): the ones past
        the prefix it took from the tree."""
        spans, partly_cached = self._own_spans(req)
        self.stats.skipped_cached += partly_cached
        return spans

    def _own_spans(self, req) -> tuple[list[Span], int]:
        """(the image spans past the tree-owned prefix, how many images straddle it: part of
        them came from the tree, so their slots are shared)."""
        if full_kv_only(req):
            return [], 0
        protected = req.kv.cache_protected_len
        spans = self.image_spans(req)
        own = [span for span in spans if span[0] >= protected]
        return own, sum(start < protected < end for start, end, _ in spans)

    def defer_chunk_checkpoint(self, req) -> bool:
        """True for a middle prefill chunk of a request with images to compress (decided in
        ``begin_forward``): its KV stays the request's own (not inserted into the tree) until
        the last chunk is compressed."""
        return req.rid in self.deferred

    def prefills_for_compression(self) -> bool:
        """Whether the extend batch ``begin_forward`` just saw prefills a prompt that compresses:
        at this chunk (a target) or at a later one (a middle chunk, kept out of the tree)."""
        return self.capture is not None or bool(self.deferred)

    def is_target(self, req) -> bool:
        """Whether ``req`` compresses at its checkpoint (``take`` would give its targets)."""
        return req.rid in self.pending and self.capture is not None

    def take(self, req) -> tuple[Pending, QueryCapture] | None:
        """The request's targets and the batch's capture, once (its checkpoint)."""
        pending = self.pending.pop(req.rid, None)
        if pending is None or self.capture is None:
            return None
        return pending, self.capture
