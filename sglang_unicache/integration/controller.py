"""The scheduler-side driver: which requests to compress, and compressing them after prefill.

Life of a request with an image (non-overlap scheduler):
1. ``begin_forward`` (before an extend batch runs): a request whose prompt ends in this extend
   and whose image spans (>= ``min_image_tokens``) are all its own (none came from the tree)
   becomes a target; its last W prompt positions are marked for query capture (``capture.py``).
   With chunked prefill, the middle chunks of such a request are kept out of the tree
   (``defer_chunk_checkpoint``), so the whole prompt is compressed at its last chunk.
2. The forward runs; the attention hook gathers the targets' observation queries per layer.
3. ``on_checkpoint`` (the request survived prefill and is about to enter the radix tree): gather
   the prompt's K/V from the pool, run the policy, write the compressed entries, compact the row,
   free N - K slots per image, and rewrite the request so every length agrees: its token ids (the
   span becomes K ids derived from the image, the config and, for query-dependent methods, the
   request), ``extend_end``, KV lengths, the batch's ``seq_lens``, and its M-RoPE data.
4. A failed self-check doubles the budget up to ``escalate_max_keep`` (counted as escalations);
   past the cap, or on any error, the request keeps its full KV (counted as a fallback or an
   error). When most recent images fall back, one warning line says so and names the keys.
5. ``on_retract`` restores the original ids and positions, so a retracted request is prefilled
   again from its real tokens (and compressed again).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from sglang_unicache.config import UniCacheConfig
from sglang_unicache.integration.capture import CaptureTarget, QueryCapture
from sglang_unicache.integration.compaction import (
    SpanResult,
    gather_prompt_kv,
    plan_compaction,
    restore_spans,
    write_spans,
)
from sglang_unicache.integration.rewrite import (
    Rewrite,
    SpanRewrite,
    original_position,
    restore,
    rewrite,
)
from sglang_unicache.integration.spans import SpanIndex, SpanMeta
from sglang_unicache.registry import build_method
from sglang_unicache.types import ImageSpan, ScoreInputs

logger = logging.getLogger("sglang_unicache")


def merge_runs(offsets) -> list[tuple[int, int]]:
    """An item's inclusive pad-token runs as ``[start, end)`` spans, runs one separator token
    apart joined (Pixtral-style towers end every row of patches with a break token: the image is
    one span, its break tokens compressed with it)."""
    spans: list[list[int]] = []
    for start, end in sorted(offsets):
        if spans and start - spans[-1][1] <= 1:
            spans[-1][1] = end + 1
        else:
            spans.append([start, end + 1])
    return [(start, end) for start, end in spans]


def rewrites_of(req) -> list[Rewrite]:
    return getattr(req, "unicache_rewrites", None) or []


def full_kv_only(req) -> bool:
    """Requests served on their full KV, like stock SGLang (neither compressed nor rewritten to
    reuse compressed spans):

    - those that return logprobs: SGLang computes their prompt logprobs over the prompt as
      sent, after the point where compaction shortens it, and counts them against its length
      (issue 14, defect 3b);
    - turns of an SGLang session (``open_session`` / ``session_params``): the session builds the
      next turn from this one's ids and multimodal inputs, which must stay the ones sent.
    """
    return bool(req.return_logprob) or getattr(req, "session", None) is not None


def namespace(req) -> tuple[object, object]:
    """The radix tree's namespace of a request: spans never cross it (tenancy)."""
    return (req.extra_key, req.cache_salt or None)

# Compressed span ids live where SGLang's image pad ids do: above every vocabulary
# (MM_PAD_SHIFT_VALUE), with 62 hash bits, so two different spans never start with the same id
# (the radix tree tells children apart by their first token).
COMPRESSED_ID_BASE = 1_000_000
COMPRESSED_ID_MASK = (1 << 62) - (1 << 24)  # room for 2**24 consecutive ids, below 2**63

# One warning line when more than this share of the last FALLBACK_WINDOW checked requests kept
# their full KV: the user is running a no-op and should know which keys to look at.
FALLBACK_WINDOW = 32
FALLBACK_WARN_SHARE = 0.5
RECENT_CHECKS = 64  # self-check outcomes kept for /server_info


@dataclass
class Stats:
    images_compressed: int = 0
    requests_compressed: int = 0
    slots_freed: int = 0
    fallbacks: int = 0  # requests whose self-check failed even at escalate_max_keep: full KV kept
    escalations: int = 0  # budget doublings after a failed self-check
    errors: int = 0  # compressions that raised: full KV kept
    retracted: int = 0  # requests retracted by the scheduler (restored to their own ids)
    skipped_cached: int = 0
    spans_reused: int = 0
    spans_recompressed: int = 0  # cached spans shrunk under memory pressure (radix_cache.py)
    recompress_slots_freed: int = 0
    vision_encoder_calls: int = 0  # Qwen2-VL image encoder batches run (tests read it)
    compress_seconds: float = 0.0  # policy + compaction, summed (benchmarks read it)
    prefill_seconds: float = 0.0  # forwards of extend batches that had targets, summed

    def to_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


@dataclass
class Pending:
    batch: object
    target: CaptureTarget
    spans: list[tuple[int, int, int]]  # (start, end, image pad id), end exclusive


@dataclass
class Controller:
    config: UniCacheConfig
    req_to_token: torch.Tensor
    kv_pool: object
    allocator: object
    stats: Stats = field(default_factory=Stats)
    pending: dict[str, Pending] = field(default_factory=dict)
    capture: QueryCapture | None = None
    metrics: object | None = None  # metrics.Metrics with --enable-metrics
    tree: object | None = None  # radix_cache.CompressedRadixCache, unless the radix cache is off
    mrope: bool = True  # positions through M-RoPE data (Qwen2-VL); else a 1-D offset per request
    # The spans the tree holds, by image (what a later request's ids are rewritten to).
    # Per request state lives on the request itself, so it dies with it (an aborted request
    # leaves nothing behind): ``req.unicache_rewrites``, every rewrite of its ids (the reuse
    # rewrite at match time, then the compression of its own images), oldest first; and
    # ``req.unicache_fresh``, the (row position, metadata) of the spans it compressed, until its
    # KV is in the tree.
    spans: SpanIndex = field(default_factory=SpanIndex)

    def __post_init__(self) -> None:
        # A slot spans every layer, so every layer keeps the same number of entries: layers whose
        # budget is smaller are filled with their next-best tokens (DESIGN.md §5).
        self.method = build_method(self.config.replace(layer_fill="next"))
        self.active = self.config.method != "full" and self.config.keep_ratio < 1.0
        self.recent_checks: deque[dict] = deque(maxlen=RECENT_CHECKS)
        self.outcomes: deque[bool] = deque(maxlen=FALLBACK_WINDOW)  # True: full KV kept
        self.since_warning = FALLBACK_WINDOW
        cfg = self.config
        if self.active and cfg.selfcheck:
            logger.info("sglang-unicache: %s at keep %.3g; self-check %s <= %.3g, escalating up "
                        "to keep %.3g before keeping full KV", cfg.method, cfg.keep_ratio,
                        cfg.selfcheck_statistic, cfg.selfcheck_threshold, cfg.escalate_max_keep)
        digest = json.dumps(self.config.to_dict(), sort_keys=True, default=str)
        self.config_digest = hashlib.sha256(digest.encode()).hexdigest()[:16]

    # -- 1. choose targets ----------------------------------------------------------------------
    def image_spans(self, req) -> list[tuple[int, int, int]]:
        mm = req.multimodal_inputs
        if mm is None:
            return []
        spans = []
        for item in mm.mm_items:
            if item.modality.name not in ("IMAGE", "MULTI_IMAGES", "VIDEO"):
                continue
            for start, end in merge_runs(item.offsets or []):
                if end - start >= self.config.min_image_tokens:
                    spans.append((start, end, int(item.pad_value or 0)))
        return sorted(spans)

    def begin_forward(self, batch) -> QueryCapture | None:
        self.pending.clear()
        self.capture = None
        if not self.active or getattr(batch, "decoding_reqs", None):
            return None
        targets, spans_of = [], {}
        offset = 0
        for i, (req, extend_len) in enumerate(zip(batch.reqs, batch.extend_lens, strict=True)):
            start_row, offset = offset, offset + extend_len
            if req.extend_end != len(req.full_untruncated_fill_ids):
                continue  # a middle chunk: compress when the prompt is complete
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

    def new_image_spans(self, req) -> list[tuple[int, int, int]]:
        """The request's images that this prefill computes (in its current ids): the ones past
        the prefix it took from the tree. Images the tree supplied (compressed spans reused, or
        an uncompressed copy) are shared and stay as they are; a later chat turn or agent step
        still compresses the new images it brings."""
        if full_kv_only(req):
            return []
        protected = req.kv.cache_protected_len
        spans = []
        for start, end, pad in self.image_spans(req):
            if start >= protected:
                spans.append((start, end, pad))
            elif end > protected:  # part of an image from the tree: its slots are shared
                self.stats.skipped_cached += 1
        return spans

    def defer_chunk_checkpoint(self, req) -> bool:
        """True for a middle prefill chunk of a request with images to compress: its KV stays
        the request's own (not inserted into the tree) until the last chunk is compressed."""
        return (self.active and req.extend_end < len(req.full_untruncated_fill_ids)
                and not full_kv_only(req)
                and any(start >= req.kv.cache_protected_len
                        for start, _, _ in self.image_spans(req)))

    # -- 3. compress ----------------------------------------------------------------------------
    def on_checkpoint(self, req) -> None:
        pending = self.pending.pop(req.rid, None)
        if pending is None or self.capture is None:
            return
        start = time.perf_counter()
        try:
            self._compress(req, pending, self.capture.queries_of(pending.target))
        except Exception:
            self.stats.errors += 1
            self._record_outcome(True)
            logger.exception("sglang-unicache: compression failed for %s; keeping full KV",
                             req.rid)
        self.stats.compress_seconds += time.perf_counter() - start

    def _buffers(self):
        pool = self.kv_pool
        layers = range(pool.start_layer, pool.start_layer + pool.layer_num)
        return ([pool.get_key_buffer(i) for i in layers],
                [pool.get_value_buffer(i) for i in layers])

    def _compress(self, req, pending: Pending, queries: list[torch.Tensor]) -> None:
        length = req.extend_end
        row_index = req.kv.req_pool_idx
        row = self.req_to_token[row_index, :length].clone()
        k_buffers, v_buffers = self._buffers()
        keys, values = gather_prompt_kv(k_buffers, v_buffers, row)
        spans = [ImageSpan(start, end) for start, end, _ in pending.spans]
        positions = torch.tensor(list(pending.target.positions), dtype=torch.int64)
        plan = self.method.plan(ScoreInputs(keys, values, spans, obs_queries=queries,
                                            obs_positions=positions))
        self._record_check(req.rid, plan)
        if plan.fallback:
            self.stats.fallbacks += 1
            logger.info("sglang-unicache: self-check failed for %s (%s %.3f > %.3f at keep %.3g);"
                        " full KV kept", req.rid, plan.selfcheck.statistic, plan.selfcheck.value,
                        plan.selfcheck.threshold, plan.keep_ratio)
            return
        results, plans = [], []
        for span_plan, (start, end, _) in zip(plan.image_plans(), pending.spans, strict=True):
            if span_plan.skipped:
                continue
            compressed = self.method.execute(span_plan, keys, values)
            results.append(SpanResult(start, end, compressed.keys, compressed.values))
            plans.append(span_plan)
        if not results:
            return
        # All or nothing: everything above only read. The ids are rewritten first (atomic, and
        # undone below on failure); then the pool, the row and the lengths change, rolled back
        # from the copies taken above if anything raises; the slots are freed last.
        compaction = plan_compaction(row, results)
        removed = compaction.removed
        self._rewrite_ids(req, pending, results)
        try:
            write_spans(row, results, k_buffers, v_buffers)
            self.req_to_token[row_index, :length - removed] = compaction.row
            self._shorten(req, pending, removed)
        except BaseException:
            restore_spans(row, results, keys, values, k_buffers, v_buffers)
            self.req_to_token[row_index, :length] = row
            restore(req, req.unicache_rewrites.pop())
            raise
        self.allocator.free(compaction.freed)
        req.unicache_fresh = self._span_metas(req, pending, results, plans, plan.selfcheck,
                                              plan.keep_ratio)
        self.stats.images_compressed += len(results)
        self.stats.requests_compressed += 1
        self.stats.slots_freed += removed
        logger.debug("sglang-unicache: %s compressed %d image(s), %d -> %d slots", req.rid,
                     len(results), length, length - removed)

    def _record_check(self, rid: str, plan) -> None:
        self.stats.escalations += plan.escalations
        check = plan.selfcheck
        if check is not None and check.checked:
            self.recent_checks.append({
                "rid": rid, "statistic": check.statistic, "value": check.value,
                "threshold": check.threshold, "passed": check.passed,
                "keep_ratio": plan.keep_ratio, "escalations": plan.escalations,
                "stats": check.stats})
        self._record_outcome(plan.fallback)

    def _record_outcome(self, full_kept: bool) -> None:
        """Warn once per window when most recent requests kept their full KV."""
        self.outcomes.append(full_kept)
        self.since_warning += 1
        share = sum(self.outcomes) / len(self.outcomes)
        if (len(self.outcomes) == FALLBACK_WINDOW and self.since_warning >= FALLBACK_WINDOW
                and share > FALLBACK_WARN_SHARE):
            self.since_warning = 0
            cfg = self.config
            logger.warning(
                "sglang-unicache: %d of the last %d image requests kept their full KV (self-check"
                " %s > %.3g even at keep %.3g); compression is mostly off: see the config keys "
                "selfcheck_threshold and escalate_max_keep (docs/selfcheck.md)",
                sum(self.outcomes), len(self.outcomes), cfg.selfcheck_statistic,
                cfg.selfcheck_threshold, max(cfg.escalate_max_keep, cfg.keep_ratio))

    def compressed_ids(self, pad_id: int, start: int, count: int) -> tuple[int, ...]:
        """Token ids of a compressed span: one per kept entry, the same for the same image at the
        same position under the same config and budget, so the radix tree can share the span;
        a different budget (e.g. after re-compression) gives ids that share no prefix."""
        key = f"{pad_id}:{start}:{self.config_digest}:{count}".encode()
        digest = int.from_bytes(hashlib.sha256(key).digest()[:8], "big")
        base = COMPRESSED_ID_BASE + (digest & COMPRESSED_ID_MASK)
        return tuple(range(base, base + count))

    def _rewrite_ids(self, req, pending: Pending, results: list[SpanResult]) -> None:
        pads = {start: pad for start, _, pad in pending.spans}
        earlier = rewrites_of(req)
        spans = [SpanRewrite(r.start, r.end, self.compressed_ids(
                    pads[r.start], original_position(r.start, earlier), r.kept))
                 for r in results]
        req.unicache_rewrites = [*earlier, rewrite(req, spans)]

    def _shorten(self, req, pending: Pending, removed: int) -> None:
        """Every length of the request and of its batch, ``removed`` entries shorter (the new
        batch tensors are built first, so nothing is assigned unless all of them could be)."""
        batch, i = pending.batch, pending.target.batch_index
        shorter = {}
        for name in ("seq_lens", "seq_lens_cpu", "orig_seq_lens"):
            lens = getattr(batch, name, None)
            if lens is not None:
                shorter[name] = lens.clone()
                shorter[name][i] -= removed
        for name, lens in shorter.items():
            setattr(batch, name, lens)
        if getattr(batch, "seq_lens_sum", None) is not None:
            batch.seq_lens_sum -= removed
        req.extend_end -= removed
        req.kv.kv_committed_len -= removed
        req.kv.kv_allocated_len -= removed

    def _span_metas(self, req, pending: Pending, results: list[SpanResult], plans,
                    selfcheck, keep_ratio: float) -> list[SpanMeta]:
        pads = {start: pad for start, _, pad in pending.spans}
        row = self.req_to_token[req.kv.req_pool_idx]
        earlier = rewrites_of(req)[:-1]  # the rewrites before this compression's own
        metas, removed_before = [], 0
        for result, span_plan in zip(results, plans, strict=True):
            layers = span_plan.layers
            at = result.start - removed_before
            start = original_position(result.start, earlier)
            metas.append((at, SpanMeta(
                namespace=namespace(req), pad=pads[result.start], start=start,
                length=result.end - result.start,
                ids=self.compressed_ids(pads[result.start], start, result.kept),
                kept=torch.stack([lp.kept for lp in layers]).to(torch.int32).cpu(),
                priority=torch.stack([
                    lp.priority if lp.priority is not None
                    else torch.zeros(lp.kept.shape) for lp in layers]).float().cpu(),
                protected=span_plan.protected.cpu(),
                merged=(torch.stack([lp.assign for lp in layers]).to(torch.int16).cpu()
                        if any(lp.merges for lp in layers) else None),
                method=span_plan.method, keep_ratio=keep_ratio,
                selfcheck=None if selfcheck is None else selfcheck.to_dict(),
                slots=row[at:at + result.kept].clone())))
            removed_before += result.end - result.start - result.kept
        return metas

    def after_insert(self, req, cache) -> None:
        """The request's KV is in the tree: index the spans it compressed itself and attach their
        metadata to the node holding each (unless the tree already held the same span, from a
        request that compressed the same image first: that one's metadata stays)."""
        metas, req.unicache_fresh = getattr(req, "unicache_fresh", None), None
        if not metas:
            return
        row = self.req_to_token[req.kv.req_pool_idx]
        for at, meta in metas:
            if not torch.equal(row[at:at + meta.count], meta.slots):
                continue  # deduplicated against the tree's copy of this span
            meta.slots = None
            node = cache.node_holding(req.last_node, meta.ids[0])
            if node is not None:
                cache.attach(node, meta)
                self.spans.add(meta)

    def move_entries(self, slots: torch.Tensor, keep: torch.Tensor) -> None:
        """Within a span's ``slots`` (K), move entries ``keep`` (``[L, H, K']``, per layer and
        head) to the first K' slots (re-compression, ``radix_cache.py``)."""
        k_buffers, v_buffers = self._buffers()
        index = slots.to(torch.int64)
        head = index[:keep.shape[-1]]
        for layer, (kb, vb) in enumerate(zip(k_buffers, v_buffers, strict=True)):
            pick = keep[layer].to(kb.device).t().unsqueeze(-1)  # [K', H, 1]
            for buf in (kb, vb):
                entries = buf.index_select(0, index)  # [K, H, D]
                buf[head] = entries.gather(0, pick.expand(-1, -1, entries.shape[-1]))

    def on_recompressed(self, freed: int) -> None:
        self.stats.spans_recompressed += 1
        self.stats.recompress_slots_freed += freed

    # -- reuse: match a waiting request against compressed spans in the tree ---------------------
    def match_with_reuse(self, match, req) -> None:
        """Run SGLang's prefix match (``match()``) with the request's known images rewritten to
        their compressed ids; keep the rewrite for the spans the tree fully holds, undo the rest.

        Waiting requests are matched again every round, so this starts from the original ids
        each time (idempotent) and leaves either a consistent rewrite or the original request.
        """
        self.undo(req)
        if not getattr(req, "retracted_stain", False):
            req.unicache_reused = 0  # SGLang counts cached_tokens at the first prefill only
        if not self.active or req.kv.holds_kv or req.is_retracted or full_kv_only(req):
            match()  # a retracted request is prefilled again from its own tokens
            return
        # SGLang matches at most the prompt's length - 1 (one token must be computed); a span
        # past that cap would be cut in the middle, so it is not rewritten.
        limit = len(req.origin_input_ids) - 1
        candidates = []
        for start, end, pad in self.image_spans(req):
            meta = self.spans.of_image((namespace(req), pad, start, end - start))
            if meta is not None and end <= limit:
                candidates.append(SpanRewrite(start, end, meta.ids))
        while candidates:
            record = rewrite(req, candidates)
            match()
            removed_before, covered = 0, []
            for span in candidates:
                if req.prefix_len >= span.start - removed_before + len(span.ids):
                    covered.append(span)
                removed_before += span.removed
            if covered == candidates:
                req.unicache_rewrites = [record]
                req.unicache_reused = record.removed  # usage: cached tokens as the user sent them
                self.stats.spans_reused += len(covered)
                return
            restore(req, record)
            candidates = covered  # a prefix of the candidates: the tree matched that far
        match()

    # -- 5. undo --------------------------------------------------------------------------------
    def undo(self, req) -> None:
        """Back to the ids, offsets and positions the user sent (every rewrite, newest first)."""
        for record in reversed(rewrites_of(req)):
            restore(req, record)
        req.unicache_rewrites = []

    def on_retract(self, req) -> None:
        self.stats.retracted += 1
        self.undo(req)
        req.unicache_fresh = None

    def gauges(self) -> dict[str, float]:
        held = self.tree.compressed_slots_held() if self.tree is not None else 0
        return {"compressed_slots_held": held}

    def snapshot(self) -> dict:
        return {**self.stats.to_dict(), **self.gauges(),
                "available_slots": int(self.allocator.available_size()),
                "radix_cache": type(self.tree).__name__ if self.tree is not None else None,
                "method": self.config.method, "keep_ratio": self.config.keep_ratio,
                "recent_checks": list(self.recent_checks)}
