"""Compressing a request's own images right after its prefill, before its KV enters the tree.

Gather the prompt's K/V from the pool (one layer at a time), plan with the configured method and
self-check the plan (``policy/compressor.py``: a failure raises the budget up to
``escalate_max_keep``, past that the request keeps its full KV), write the compressed entries,
compact the row, rewrite the request so every length agrees (its token ids: each span becomes K
ids derived from the image, its position, the config and, for query-dependent methods, the
request, ``variant``; ``extend_end``, KV lengths, the batch's ``seq_lens``, its M-RoPE data),
and only then free N - K slots per image (``kvpool.Slots``). Any error before the free rolls all
of it back. With host copies, the full KV of the request's first image is packed for the host
store between the plan and the write (``recall.py``) and kept once the compression holds. With
``--tp-size`` the plan and the write each end in a verdict every rank shares
(``scale/tensor_parallel.py``), so a failure on one rank keeps the full KV on all.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sglang_unicache.engine.capture import QueryCapture
from sglang_unicache.engine.cpu_threads import one_thread_on_cpu
from sglang_unicache.engine.kvpool import (
    Slots,
    SpanResult,
    backup_slots,
    plan_compaction,
    pool_buffers,
    prompt_kv,
    restore_slots,
    write_spans,
)
from sglang_unicache.engine.outcomes import Outcomes
from sglang_unicache.engine.recall import Recall
from sglang_unicache.engine.request import namespace, state_of
from sglang_unicache.engine.rewrite import SpanRewrite, original_position, restore, rewrite, shorten
from sglang_unicache.engine.scale.tensor_parallel import PeerFailed, TensorParallel
from sglang_unicache.engine.spans import SpanMeta, SpanNaming
from sglang_unicache.engine.stats import Stats
from sglang_unicache.engine.targets import Pending
from sglang_unicache.policy.compressor import Method
from sglang_unicache.policy.inputs import ImageSpan, ScoreInputs

logger = logging.getLogger("sglang_unicache")

# What a compression attempt did (the first number of the ranks' fingerprint).
COMPRESSED, FALLBACK, UNCHANGED, ERROR = 0.0, 1.0, 2.0, 3.0


@dataclass
class Applied:
    """A compression written into the pool and the request, its slots not yet freed."""

    freed: torch.Tensor  # slots the request no longer uses
    removed: int  # how much shorter its row is (fewer than ``freed`` hold in a paged pool)
    undo: Callable[[], None]  # back to the full KV, exactly


@dataclass
class Compression:
    method: Method
    naming: SpanNaming
    req_to_token: torch.Tensor
    kv_pool: object
    slots: Slots
    tp: TensorParallel
    stats: Stats
    outcomes: Outcomes
    recall: Recall | None = None  # host copies on
    page_size: int = 1  # the pool's ``--page-size``

    def run(self, req, pending: Pending, capture: QueryCapture) -> None:
        start = time.perf_counter()
        with one_thread_on_cpu(self.req_to_token.device):
            outcome = self._attempt(req, pending, capture)
        # Every tensor-parallel rank reaches this line for the same request, whatever happened.
        if not self.tp.agree([*outcome, float(self.slots.allocator.available_size())]):
            self.stats.rank_disagreements += 1
            logger.error("sglang-unicache: tensor-parallel ranks compressed %s differently "
                         "(rank %d: %s)", req.rid, self.tp.rank, outcome)
        self.stats.compress_seconds += time.perf_counter() - start

    def _attempt(self, req, pending: Pending, capture: QueryCapture) -> list[float]:
        """Compress the request's own image spans in two steps, each ending in a verdict every
        tensor-parallel rank shares (``TensorParallel.settle``): plan (read only), then apply
        (undone on every rank unless every rank applied); the slots are freed last. Returns
        (outcome, keep ratio, slots the spans kept), the fingerprint the ranks compare."""
        queries = capture.queries_of(pending.target)
        if len(queries) != self.kv_pool.layer_num:
            return self._capture_missed(req, len(queries))
        planned = self._step(req, "plan", lambda: self._plan(req, pending, queries))
        if planned is None:
            return [ERROR, 0.0, 0.0]
        plan, results, plans = planned
        self.outcomes.check(req.rid, plan)
        if plan.fallback:
            self.stats.fallbacks += 1
            logger.info("sglang-unicache: self-check failed for %s (%s) at keep %.3g; full KV "
                        "kept", req.rid, plan.selfcheck.failure(), plan.keep_ratio)
            return [FALLBACK, plan.keep_ratio, 0.0]
        if not results:
            return [UNCHANGED, plan.keep_ratio, 0.0]
        copied = self._step(req, "copy", lambda: self._copy(req, results))
        if copied is None:
            return [ERROR, 0.0, 0.0]
        applied = self._step(req, "apply", lambda: self._apply(req, pending, results))
        if applied is None:
            return [ERROR, 0.0, 0.0]
        self.slots.free(applied.freed)
        host = self.recall.keep(copied[0]) if self.recall is not None else None
        state_of(req).fresh = self._span_metas(req, pending, results, plans, plan.selfcheck,
                                               plan.keep_ratio, host)
        self.stats.images_compressed += len(results)
        self.stats.requests_compressed += 1
        self.stats.slots_freed += applied.freed.numel()
        logger.debug("sglang-unicache: %s compressed %d image(s), %d -> %d tokens", req.rid,
                     len(results), req.extend_end + applied.removed, req.extend_end)
        return [COMPRESSED, plan.keep_ratio, float(sum(p.physical_slots for p in plans))]

    def _step(self, req, name: str, run):
        """Run one step of a compression; its result when every rank succeeded, else None (the
        request keeps its full KV, counted once as an error on every rank)."""
        result, failed, peer_failed = None, False, False
        start = time.perf_counter()
        try:
            result = run()
        except PeerFailed:  # this rank already knows the verdict: no settle round
            peer_failed = True
        except Exception:
            failed = True
            logger.exception("sglang-unicache: compression (%s) failed for %s; keeping full KV",
                             name, req.rid)
        seconds = f"compress_{name}_seconds"
        setattr(self.stats, seconds, getattr(self.stats, seconds) + time.perf_counter() - start)
        if peer_failed or not self.tp.settle(failed):
            if not failed:
                logger.error("sglang-unicache: another tensor-parallel rank failed to %s %s; "
                             "keeping full KV", name, req.rid)
            if isinstance(result, Applied):
                result.undo()
            self.stats.errors += 1
            self.outcomes.record(True)
            return None
        return result

    def _capture_missed(self, req, layers: int) -> list[float]:
        self.stats.capture_missed += 1
        if self.stats.capture_missed == 1:
            logger.warning("sglang-unicache: the prefill of %s ran %d of %d attention layers "
                           "through the hook that reads its queries (a CUDA-graph or fused "
                           "path?); its images keep their full KV, as will others like it",
                           req.rid, layers, self.kv_pool.layer_num)
        self.outcomes.record(True)
        return [UNCHANGED, 0.0, 0.0]

    def _plan(self, req, pending: Pending, queries: list[torch.Tensor]):
        """Read only: the request's plan and, unless it falls back, each span's compressed
        entries. (plan, span results, span plans)."""
        row = self.req_to_token[req.kv.req_pool_idx, :req.extend_end]
        k_buffers, v_buffers = pool_buffers(self.kv_pool)
        keys, values = prompt_kv(k_buffers, v_buffers, row)
        spans = self._spans(pending)
        positions = torch.tensor(list(pending.target.positions), dtype=torch.int64)
        plan = self.method.plan(ScoreInputs(keys, values, spans, obs_queries=queries,
                                            obs_positions=positions),
                                self.tp.shards(keys[0].shape[1]))
        results, plans = [], []
        if not plan.fallback:
            for span_plan in self._compacted(plan.image_plans()):
                span = span_plan.span  # its own rows only, read a layer at a time
                span_keys, span_values = prompt_kv(k_buffers, v_buffers,
                                                   row[span.start:span.end])
                compressed = self.method.execute(span_plan, span_keys, span_values,
                                                 span_local=True)
                results.append(SpanResult(span.start, span.end, compressed.keys,
                                          compressed.values))
                plans.append(span_plan)
        return plan, results, plans

    def _spans(self, pending: Pending) -> list[ImageSpan]:
        """The request's new image spans as the policy plans them. In a paged pool each carries
        the page offset its entries will start at: the text since the last span that compacts
        (which ends on a page boundary), or since the row's start."""
        spans, boundary, size = [], 0, self.page_size
        for start, end, _ in pending.spans:
            spans.append(ImageSpan(start, end, page=(size, (start - boundary) % size)))
            if size > 1 and end - start >= max(self.method.config.min_image_tokens, size):
                boundary = end  # expected to compact; checked against the plans in _compacted
        return spans

    def _compacted(self, plans):
        """The span plans compaction writes: those that keep fewer entries than their span.
        In a paged pool a span that keeps every entry (too short for its page) ends where it
        ends, not on a page boundary, so the page offsets of the spans after it (``_spans``)
        may not hold: from there on the spans keep their full KV."""
        out, boundary = [], 0
        for span_plan in plans:
            span = span_plan.span
            size, offset = span.page
            if size > 1 and (span.start - boundary) % size != offset:
                break
            if span_plan.skipped or span_plan.physical_slots >= span.length:
                continue
            out.append(span_plan)
            boundary = span.end
        return out

    def _copy(self, req, results: list[SpanResult]) -> tuple:
        """Read only: the host copy to keep of the request's first image, if it gets one."""
        if self.recall is None:
            return (None,)
        row = self.req_to_token[req.kv.req_pool_idx, :req.extend_end]
        return (self.recall.take(req, [r.start for r in results], row),)

    def _apply(self, req, pending: Pending, results: list[SpanResult]) -> Applied:
        """Write the compressed entries, compact the row, rewrite the ids and shorten every
        length; all or nothing (a failure undoes what was done, from the copies taken first).
        The slots to free are returned, not freed: another rank may still fail this step."""
        length = req.extend_end
        row_index = req.kv.req_pool_idx
        row = self.req_to_token[row_index, :length].clone()
        k_buffers, v_buffers = pool_buffers(self.kv_pool)
        compaction = plan_compaction(row, results, self.page_size)
        removed = compaction.removed
        backup = backup_slots(compaction, k_buffers, v_buffers)
        self._rewrite_ids(req, pending, results)
        shortened = False

        def undo() -> None:
            if shortened:
                shorten(req, pending.batch, pending.target.batch_index, -removed)
            restore_slots(compaction, backup, k_buffers, v_buffers)
            self.req_to_token[row_index, :length] = row
            restore(req, state_of(req).rewrites.pop())

        try:
            write_spans(compaction, results, k_buffers, v_buffers)
            self.req_to_token[row_index, :length - removed] = compaction.row
            shorten(req, pending.batch, pending.target.batch_index, removed)
            shortened = True
        except BaseException:
            undo()
            raise
        return Applied(compaction.freed, removed, undo)

    def variant(self, req) -> str:
        """What keys a span besides its image, position, config and size: for a method whose
        selection follows the question, the request, so two requests that compress the same
        image in one batch each decode on their own checked plan (the second one's insert
        would otherwise repoint it to the first one's slots, a selection never checked for it).
        Later requests reuse whichever copy they find (``SpanIndex.id_choices``)."""
        return req.rid if self.method.query_dependent else ""

    def _rewrite_ids(self, req, pending: Pending, results: list[SpanResult]) -> None:
        pads = {start: pad for start, _, pad in pending.spans}
        state = state_of(req)
        variant = self.variant(req)
        spans = [SpanRewrite(r.start, r.end, self.naming.ids(
                    pads[r.start], original_position(r.start, state.rewrites), r.count, variant))
                 for r in results]
        state.rewrites = [*state.rewrites, rewrite(req, spans)]

    def _span_metas(self, req, pending: Pending, results: list[SpanResult], plans,
                    selfcheck, keep_ratio: float, host) -> list[tuple[int, SpanMeta]]:
        """Each compressed span's metadata by its place in the compacted row; ``host``: the key
        of the host copy just stored (of the request's first image), if any."""
        pads = {start: pad for start, _, pad in pending.spans}
        row = self.req_to_token[req.kv.req_pool_idx]
        *earlier, own = state_of(req).rewrites  # this compression's rewrite is the newest
        metas, removed_before, variant = [], 0, self.variant(req)
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
                slots=row[at:at + result.count].clone(),
                host=host if host is not None and host[2] == start else None)))
            removed_before += result.end - result.start - result.count
        return metas
