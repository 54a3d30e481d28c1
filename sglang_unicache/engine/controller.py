"""The scheduler-side driver: which requests to compress, and compressing them after prefill.

Life of a request with an image (with the overlap scheduler, ``hooks.around_get_next_batch_to_run``
processes a compressing prefill's result before the next batch is built, so the order is the same):
1. ``begin_forward`` (before an extend batch runs): a request whose prompt ends in this extend
   and whose image spans (>= ``min_image_tokens``) are all its own (none came from the tree)
   becomes a target; its last W prompt positions are marked for query capture (``capture.py``).
   With chunked prefill, the middle chunks of such a request are kept out of the tree
   (``defer_chunk_checkpoint``), so the whole prompt is compressed at its last chunk.
2. The forward runs; the attention hook gathers the targets' observation queries per layer.
3. ``on_checkpoint`` (the request survived prefill and is about to enter the radix tree): gather
   the prompt's K/V from the pool, run the policy, write the compressed entries, compact the row,
   free N - K slots per image, and rewrite the request so every length agrees: its token ids
   (the span becomes K ids derived from the image, the config and, for query-dependent methods,
   the request: ``_variant``), ``extend_end``, KV lengths, the batch's ``seq_lens``, and its
   M-RoPE data. With ``--tp-size`` the plan and the write each end in a verdict every rank
   shares (``tensor_parallel.py``), so a failure on one rank keeps the full KV on all.
4. A failed self-check doubles the budget up to ``escalate_max_keep`` (counted as escalations);
   past the cap, or on any error, the request keeps its full KV (counted as a fallback or an
   error). When most recent images fall back, one warning line says so and names the keys.
5. ``on_retract`` restores the original ids and positions, so a retracted request is prefilled
   again from its real tokens (and compressed again).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from sglang_unicache.engine.capture import CaptureTarget, QueryCapture
from sglang_unicache.engine.compaction import (
    SpanResult,
    backup_spans,
    plan_compaction,
    pool_buffers,
    prompt_kv,
    restore_spans,
    write_spans,
)
from sglang_unicache.engine.radix_cache import SpanSettings
from sglang_unicache.engine.rewrite import (
    Rewrite,
    SpanRewrite,
    original_position,
    restore,
    rewrite,
    shorten,
)
from sglang_unicache.engine.scale.tensor_parallel import PeerFailed, TensorParallel
from sglang_unicache.engine.spans import SpanIndex, SpanMeta, SpanNaming
from sglang_unicache.policy.config import UniCacheConfig
from sglang_unicache.policy.inputs import ImageSpan, ScoreInputs
from sglang_unicache.policy.registry import build_method

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
      sent, after the point where compaction shortens it, and counts them against its length;
    - turns of an SGLang session (``open_session`` / ``session_params``): the session builds the
      next turn from this one's ids and multimodal inputs, which must stay the ones sent;
    - beam search (``beam_width``): the members copy the leader's prompt row inside the
      forward, before the leader reaches its checkpoint, so a compaction there would free slots
      the members still read; and a beam group's prompt length is fixed at admission, before
      any match-time rewrite;
    - requests SGLang keeps out of the radix tree (``skip_radix_cache_insert``: beam leaders,
      requests whose embeddings are overridden, so their KV is not what their ids say).
    """
    return (bool(req.return_logprob) or req.session is not None or req.beam_group is not None
            or req.skip_radix_cache_insert)


def namespace(req) -> tuple[object, object]:
    """The radix tree's namespace of a request: spans never cross it (tenancy)."""
    return (req.extra_key, req.cache_salt or None)


# One warning line when more than this share of the last FALLBACK_WINDOW checked requests kept
# their full KV: the user is running a no-op and should know which keys to look at.
FALLBACK_WINDOW = 32
FALLBACK_WARN_SHARE = 0.5
RECENT_CHECKS = 64  # self-check outcomes kept for /server_info
# What a compression attempt did (the first number of the ranks' fingerprint).
COMPRESSED, FALLBACK, UNCHANGED, ERROR = 0.0, 1.0, 2.0, 3.0


_NO_SPANS = SpanIndex()  # without a radix cache nothing is reused


@dataclass
class Stats:
    images_compressed: int = 0
    requests_compressed: int = 0
    slots_freed: int = 0
    fallbacks: int = 0  # requests whose self-check failed even at escalate_max_keep: full KV kept
    escalations: int = 0  # budget doublings after a failed self-check
    errors: int = 0  # compressions that raised (on any tensor-parallel rank): full KV kept
    capture_missed: int = 0  # prefills whose attention ran past the query hook: full KV kept
    rank_disagreements: int = 0  # --tp-size: compressions the ranks did not do alike
    retracted: int = 0  # requests retracted by the scheduler (restored to their own ids)
    skipped_cached: int = 0
    spans_reused: int = 0
    images_prefilled: int = 0  # image spans a prefill computed (SGLang encodes exactly these)
    compress_seconds: float = 0.0  # policy + compaction, summed (benchmarks read it)
    prefill_seconds: float = 0.0  # forwards of extend batches that had targets, summed

    def to_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


@dataclass
class Applied:
    """A compression written into the pool and the request, its slots not yet freed."""

    freed: torch.Tensor  # slots the request no longer uses
    undo: Callable[[], None]  # back to the full KV, exactly

    @property
    def removed(self) -> int:
        return self.freed.numel()


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
    # radix_cache.CompressedRadixCache, unless the radix cache is off: it owns the cached spans'
    # metadata and the index by image (what a later request's ids are rewritten to).
    tree: object | None = None
    mrope: bool = True  # positions through M-RoPE data (Qwen2-VL); else a 1-D offset per request
    dp_rank: int = 0  # which data-parallel replica this scheduler is (/server_info shows it)
    tp: TensorParallel = field(default_factory=TensorParallel)  # --tp-size: the ranks agree
    # Per request state lives on the request itself, so it dies with it (an aborted request
    # leaves nothing behind): ``req.unicache_rewrites``, every rewrite of its ids (the reuse
    # rewrite at match time, then the compression of its own images), oldest first;
    # ``req.unicache_fresh``, the (row position, metadata) of the spans it compressed, until its
    # KV is in the tree; ``req.unicache_matched``, the span index epoch its reuse was decided at.
    deferred: set[str] = field(default_factory=set)  # rids whose checkpoint waits (this round)
    multi_run_noted: bool = False  # the one log line about items in several runs was written

    def __post_init__(self) -> None:
        # A slot spans every layer, so every layer keeps the same number of entries: layers whose
        # budget is smaller are filled with their next-best tokens. The config kept (and shown
        # in /server_info) is the one in effect.
        self.config = self.config.replace(layer_fill="next")
        self.method = build_method(self.config)
        self.active = self.config.method != "full" and self.config.keep_ratio < 1.0
        self.recent_checks: deque[dict] = deque(maxlen=RECENT_CHECKS)
        self.outcomes: deque[bool] = deque(maxlen=FALLBACK_WINDOW)  # True: full KV kept
        self.since_warning = FALLBACK_WINDOW
        cfg = self.config
        if self.active and cfg.selfcheck:
            logger.info("sglang-unicache: %s at keep %.3g; self-check %s <= %.3g and content_lost"
                        " <= %.3g, escalating up to keep %.3g before keeping full KV",
                        cfg.method, cfg.keep_ratio, cfg.selfcheck_statistic,
                        cfg.selfcheck_threshold, cfg.selfcheck_content_threshold,
                        cfg.escalate_max_keep)
        self.naming = SpanNaming.of(self.config)
        if self.tree is not None:
            self.tree.enable_spans(SpanSettings(self.naming, cfg.recompress,
                                                cfg.recompress_factor, cfg.recompress_floor))

    @property
    def spans(self) -> SpanIndex:
        return self.tree.spans if self.tree is not None else _NO_SPANS

    def rank_errors(self) -> list[str]:
        """The tensor-parallel agreement check's findings, as ``check_integrity`` lines."""
        n = self.stats.rank_disagreements
        return [f"{n} compression(s) differed between tensor-parallel ranks"] if n else []

    # -- 1. choose targets ----------------------------------------------------------------------
    def image_spans(self, req) -> list[tuple[int, int, int]]:
        mm = req.multimodal_inputs
        if mm is None:
            return []
        spans = []
        for item in mm.mm_items:
            if item.modality.name not in ("IMAGE", "MULTI_IMAGES", "VIDEO"):
                continue
            runs = merge_runs(item.offsets or [])
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
        if not self.active or getattr(batch, "decoding_reqs", None):
            return None
        targets, spans_of = [], {}
        offset = 0
        for i, (req, extend_len) in enumerate(zip(batch.reqs, batch.extend_lens, strict=True)):
            start_row, offset = offset, offset + extend_len
            if req.extend_end != len(req.full_untruncated_fill_ids):
                # A middle chunk: compress when the prompt is complete.
                if self._owns_images(req):
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

    def new_image_spans(self, req) -> list[tuple[int, int, int]]:
        """The request's images that this prefill computes (in its current ids): the ones past
        the prefix it took from the tree. Images the tree supplied (compressed spans reused, or
        an uncompressed copy) are shared and stay as they are; a later chat turn or agent step
        still compresses the new images it brings."""
        spans, partly_cached = self._own_spans(req)
        self.stats.skipped_cached += partly_cached
        return spans

    def _own_spans(self, req) -> tuple[list[tuple[int, int, int]], int]:
        """(the image spans past the tree-owned prefix, how many images straddle it: part of
        them came from the tree, so their slots are shared)."""
        if full_kv_only(req):
            return [], 0
        protected = req.kv.cache_protected_len
        spans = self.image_spans(req)
        own = [span for span in spans if span[0] >= protected]
        return own, sum(start < protected < end for start, end, _ in spans)

    def _owns_images(self, req) -> bool:
        return bool(self._own_spans(req)[0])

    def defer_chunk_checkpoint(self, req) -> bool:
        """True for a middle prefill chunk of a request with images to compress (decided in
        ``begin_forward``): its KV stays the request's own (not inserted into the tree) until
        the last chunk is compressed."""
        return req.rid in self.deferred

    # -- 3. compress ----------------------------------------------------------------------------
    def on_checkpoint(self, req) -> None:
        pending = self.pending.pop(req.rid, None)
        if pending is None or self.capture is None:
            return
        start = time.perf_counter()
        outcome = self._attempt(req, pending)
        # Every tensor-parallel rank reaches this line for the same request, whatever happened.
        if not self.tp.agree([*outcome, float(self.allocator.available_size())]):
            self.stats.rank_disagreements += 1
            logger.error("sglang-unicache: tensor-parallel ranks compressed %s differently "
                         "(rank %d: %s)", req.rid, self.tp.rank, outcome)
        self.stats.compress_seconds += time.perf_counter() - start

    def _attempt(self, req, pending: Pending) -> list[float]:
        """Compress the request's own image spans in two steps, each ending in a verdict every
        tensor-parallel rank shares (``TensorParallel.settle``): plan (read only), then apply
        (undone on every rank unless every rank applied); the slots are freed last. Returns
        (outcome, keep ratio, slots the spans kept), the fingerprint the ranks compare."""
        queries = self.capture.queries_of(pending.target)
        if len(queries) != self.kv_pool.layer_num:
            return self._capture_missed(req, len(queries))
        planned = self._step(req, "plan", lambda: self._plan(req, pending, queries))
        if planned is None:
            return [ERROR, 0.0, 0.0]
        plan, results, plans = planned
        self._record_check(req.rid, plan)
        if plan.fallback:
            self.stats.fallbacks += 1
            check = plan.selfcheck
            logger.info("sglang-unicache: self-check failed for %s (%s) at keep %.3g; full KV "
                        "kept", req.rid, check.failure(), plan.keep_ratio)
            return [FALLBACK, plan.keep_ratio, 0.0]
        if not results:
            return [UNCHANGED, plan.keep_ratio, 0.0]
        applied = self._step(req, "apply", lambda: self._apply(req, pending, results))
        if applied is None:
            return [ERROR, 0.0, 0.0]
        self.allocator.free(applied.freed)
        req.unicache_fresh = self._span_metas(req, pending, results, plans, plan.selfcheck,
                                              plan.keep_ratio)
        removed = applied.removed
        self.stats.images_compressed += len(results)
        self.stats.requests_compressed += 1
        self.stats.slots_freed += removed
        logger.debug("sglang-unicache: %s compressed %d image(s), %d -> %d slots", req.rid,
                     len(results), req.extend_end + removed, req.extend_end)
        return [COMPRESSED, plan.keep_ratio, float(sum(p.physical_slots for p in plans))]

    def _step(self, req, name: str, run):
        """Run one step of a compression; its result when every rank succeeded, else None (the
        request keeps its full KV, counted once as an error on every rank)."""
        result, failed, peer_failed = None, False, False
        try:
            result = run()
        except PeerFailed:  # this rank already knows the verdict: no settle round
            peer_failed = True
        except Exception:
            failed = True
            logger.exception("sglang-unicache: compression (%s) failed for %s; keeping full KV",
                             name, req.rid)
        if peer_failed or not self.tp.settle(failed):
            if not failed:
                logger.error("sglang-unicache: another tensor-parallel rank failed to %s %s; "
                             "keeping full KV", name, req.rid)
            if isinstance(result, Applied):
                result.undo()
            self.stats.errors += 1
            self._record_outcome(True)
            return None
        return result

    def _capture_missed(self, req, layers: int) -> list[float]:
        self.stats.capture_missed += 1
        if self.stats.capture_missed == 1:
            logger.warning("sglang-unicache: the prefill of %s ran %d of %d attention layers "
                           "through the hook that reads its queries (a CUDA-graph or fused "
                           "path?); its images keep their full KV, as will others like it",
                           req.rid, layers, self.kv_pool.layer_num)
        self._record_outcome(True)
        return [UNCHANGED, 0.0, 0.0]

    def _plan(self, req, pending: Pending, queries: list[torch.Tensor]):
        """Read only: the request's plan and, unless it falls back, each span's compressed
        entries. (plan, span results, span plans)."""
        row = self.req_to_token[req.kv.req_pool_idx, :req.extend_end]
        k_buffers, v_buffers = pool_buffers(self.kv_pool)
        keys, values = prompt_kv(k_buffers, v_buffers, row)
        spans = [ImageSpan(start, end) for start, end, _ in pending.spans]
        positions = torch.tensor(list(pending.target.positions), dtype=torch.int64)
        plan = self.method.plan(ScoreInputs(keys, values, spans, obs_queries=queries,
                                            obs_positions=positions),
                                self.tp.shards(keys[0].shape[1]))
        results, plans = [], []
        if not plan.fallback:
            for span_plan, (start, end, _) in zip(plan.image_plans(), pending.spans,
                                                  strict=True):
                if span_plan.skipped:
                    continue
                compressed = self.method.execute(span_plan, keys, values)
                results.append(SpanResult(start, end, compressed.keys, compressed.values))
                plans.append(span_plan)
        return plan, results, plans

    def _apply(self, req, pending: Pending, results: list[SpanResult]) -> Applied:
        """Write the compressed entries, compact the row, rewrite the ids and shorten every
        length; all or nothing (a failure undoes what was done, from the copies taken first).
        The slots to free are returned, not freed: another rank may still fail this step."""
        length = req.extend_end
        row_index = req.kv.req_pool_idx
        row = self.req_to_token[row_index, :length].clone()
        k_buffers, v_buffers = pool_buffers(self.kv_pool)
        compaction = plan_compaction(row, results)
        removed = compaction.removed
        backup = backup_spans(row, results, k_buffers, v_buffers)
        self._rewrite_ids(req, pending, results)
        shortened = False

        def undo() -> None:
            if shortened:
                shorten(req, pending.batch, pending.target.batch_index, -removed)
            restore_spans(row, results, backup, k_buffers, v_buffers)
            self.req_to_token[row_index, :length] = row
            restore(req, req.unicache_rewrites.pop())

        try:
            write_spans(row, results, k_buffers, v_buffers)
            self.req_to_token[row_index, :length - removed] = compaction.row
            shorten(req, pending.batch, pending.target.batch_index, removed)
            shortened = True
        except BaseException:
            undo()
            raise
        return Applied(compaction.freed, undo)

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
                " %s > %.3g or content_lost > %.3g even at keep %.3g); compression is mostly "
                "off: see the config keys selfcheck_threshold, selfcheck_content_threshold and "
                "escalate_max_keep (docs/selfcheck.md)",
                sum(self.outcomes), len(self.outcomes), cfg.selfcheck_statistic,
                cfg.selfcheck_threshold, cfg.selfcheck_content_threshold,
                max(cfg.escalate_max_keep, cfg.keep_ratio))

    def _variant(self, req) -> str:
        """What keys a span besides its image, position, config and size: for a method whose
        selection follows the question, the request, so two requests that compress the same
        image in one batch each decode on their own checked plan (the second one's insert
        would otherwise repoint it to the first one's slots, a selection never checked for it).
        Later requests reuse whichever copy they find (``SpanIndex.id_choices``)."""
        return req.rid if self.method.query_dependent else ""

    def _rewrite_ids(self, req, pending: Pending, results: list[SpanResult]) -> None:
        pads = {start: pad for start, _, pad in pending.spans}
        earlier = rewrites_of(req)
        variant = self._variant(req)
        spans = [SpanRewrite(r.start, r.end, self.naming.ids(
                    pads[r.start], original_position(r.start, earlier), r.count, variant))
                 for r in results]
        req.unicache_rewrites = [*earlier, rewrite(req, spans)]

    def _span_metas(self, req, pending: Pending, results: list[SpanResult], plans,
                    selfcheck, keep_ratio: float) -> list[SpanMeta]:
        pads = {start: pad for start, _, pad in pending.spans}
        row = self.req_to_token[req.kv.req_pool_idx]
        *earlier, own = rewrites_of(req)  # this compression's rewrite is the newest
        metas, removed_before, variant = [], 0, self._variant(req)
        for result, span_plan, span in zip(results, plans, own.spans, strict=True):
            layers = span_plan.layers
            at = result.start - removed_before
            start = original_position(result.start, earlier)
            metas.append((at, SpanMeta(
                namespace=namespace(req), pad=pads[result.start], start=start,
                length=result.end - result.start, ids=span.ids, variant=variant,
                kept=torch.stack([lp.kept for lp in layers]).to(torch.int32).cpu(),
                priority=torch.stack([
                    lp.priority if lp.priority is not None
                    else torch.zeros(lp.kept.shape) for lp in layers]).float().cpu(),
                merged=(torch.stack([lp.assign for lp in layers]).to(torch.int16).cpu()
                        if any(lp.merges for lp in layers) else None),
                method=span_plan.method, keep_ratio=keep_ratio,
                selfcheck=None if selfcheck is None else selfcheck.to_dict(),
                slots=row[at:at + result.count].clone())))
            removed_before += result.end - result.start - result.count
        return metas

    # -- reuse: match a waiting request against compressed spans in the tree ---------------------
    def match_with_reuse(self, match, req) -> None:
        """Run SGLang's prefix match (``match()``) with the request's known images rewritten to
        their compressed ids; keep the rewrite for the spans the tree fully holds, undo the rest.

        Waiting requests are matched again every round. Which spans to rewrite is decided again
        only when the span index changed since the request's last decision (``SpanIndex.epoch``:
        a span added, evicted or re-compressed); otherwise the request keeps the ids that decision
        left and only SGLang's own match runs, as for any request. A new decision starts from the
        original ids (idempotent) and leaves either a consistent rewrite or the original request.
        """
        eligible = not (not self.active or req.kv.holds_kv or req.is_retracted
                        or full_kv_only(req))
        if eligible and getattr(req, "unicache_matched", None) == self.spans.epoch:
            match()
            return
        self.undo(req)
        if not getattr(req, "retracted_stain", False):
            req.unicache_reused = 0  # SGLang counts cached_tokens at the first prefill only
        if not eligible:
            match()  # a retracted request is prefilled again from its own tokens
            return
        req.unicache_matched = self.spans.epoch
        # SGLang matches at most the prompt's length - 1 (one token must be computed); a span
        # past that cap would be cut in the middle, so it is not rewritten.
        limit = len(req.origin_input_ids) - 1
        choices: dict[int, list[tuple[int, ...]]] = {}  # span start -> ids to try, newest first
        candidates = []
        for start, end, pad in self.image_spans(req):
            options = self.spans.id_choices((namespace(req), pad, start, end - start))
            if options and end <= limit:
                choices[start] = options
                candidates.append(SpanRewrite(start, end, options[0]))
        while candidates:
            record = rewrite(req, candidates)
            match()
            # A span HiCache holds only in host memory counts: admission loads it back.
            matched = req.prefix_len + getattr(req, "host_hit_length", 0)
            removed_before, covered = 0, []
            for span in candidates:
                if matched < span.start - removed_before + len(span.ids):
                    break
                covered.append(span)
                removed_before += span.removed
            if covered == candidates:
                req.unicache_rewrites = [record]
                req.unicache_reused = record.removed  # usage: cached tokens as the user sent them
                self.stats.spans_reused += len(covered)
                return
            restore(req, record)
            # The tree matched up to the first span it does not hold under these ids: try that
            # image's next cached copy (another prefix's, or another request's plan), else stop
            # before it.
            missed = candidates[len(covered)]
            options = choices[missed.start]
            at = options.index(missed.ids) + 1
            if at < len(options):
                candidates[len(covered)] = SpanRewrite(missed.start, missed.end, options[at])
            else:
                candidates = covered
        match()

    # -- 5. undo --------------------------------------------------------------------------------
    def undo(self, req) -> None:
        """Back to the ids, offsets and positions the user sent (every rewrite, newest first)."""
        for record in reversed(rewrites_of(req)):
            restore(req, record)
        req.unicache_rewrites = []
        req.unicache_matched = None

    def on_retract(self, req) -> None:
        self.stats.retracted += 1
        self.undo(req)
        req.unicache_fresh = None

    def gauges(self) -> dict[str, float]:
        held = self.tree.compressed_slots_held() if self.tree is not None else 0
        host = self.tree.host.spans if self.tree is not None else 0
        return {"compressed_slots_held": held, "spans_on_host": host}

    def publish(self) -> None:
        """Counters and gauges to ``/metrics`` (with ``--enable-metrics``)."""
        if self.metrics is not None:
            self.metrics.sync(self.counters(), self.gauges())

    def counters(self) -> dict[str, float]:
        shrunk = self.tree.recompressed if self.tree is not None else None
        host = self.tree.host if self.tree is not None else None
        return {**self.stats.to_dict(),
                "spans_recompressed": shrunk.spans if shrunk else 0,
                "recompress_slots_freed": shrunk.slots_freed if shrunk else 0,
                "spans_loaded_back": host.loaded_back if host else 0,
                "load_back_waits": host.load_back_waits if host else 0}

    def snapshot(self) -> dict:
        return {"dp_rank": self.dp_rank, **self.counters(), **self.gauges(),
                "available_slots": int(self.allocator.available_size()),
                "radix_cache": type(self.tree).__name__ if self.tree is not None else None,
                "method": self.config.method, "keep_ratio": self.config.keep_ratio,
                "config": self.config.to_dict(),
                "recent_checks": list(self.recent_checks)}
