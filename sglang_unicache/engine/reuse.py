"""Reuse at match time: a waiting request's known images rewritten to the compressed spans the
tree holds, so SGLang's own prefix match takes them (no encoding, no prefill for them).

For each image of the request the span index names every cached copy (``SpanIndex.id_choices``,
newest first); the request is rewritten to them and matched. Spans the tree holds completely
stay rewritten; for the first one it does not hold, the image's next copy is tried, else the
request stops before it; the rest are restored to the original ids.

With host copies (``recall.py``) the device decision is the first half: a request whose first
image has a host copy is then planned for recall instead, keeping the history the device match
found behind the compressed copy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sglang_unicache.engine.recall import Recall
from sglang_unicache.engine.request import full_kv_only, namespace, state_of
from sglang_unicache.engine.rewrite import SpanRewrite, restore, rewrite
from sglang_unicache.engine.spans import SpanIndex
from sglang_unicache.engine.stats import Stats
from sglang_unicache.engine.targets import Targets

# Copies of a request's first image tried for the one reaching furthest into its prompt.
MAX_COPIES_TRIED = 8


def encodes_past_reused_spans(req) -> bool:
    """A LLaVA-NeXT/OneVision request (``LlavaBaseForCausalLM``, the only models that record
    ``image_pad_len``) that reuses compressed spans and still has an image to encode past them.
    Its forward places image features at ``image_offsets - prefix_len``: the offsets are in the
    ids the user sent, the prefix length in the compacted row's, so the new image's features
    would land ``removed`` rows late (and the reused image's over the new one). Such a request
    is matched on its original ids instead; one whose images all lie in the reused prefix
    encodes nothing and keeps the reuse."""
    mm = req.multimodal_inputs
    if mm is None or not getattr(mm, "image_pad_len", None):
        return False
    prefix = req.prefix_len + (getattr(req, "host_hit_length", 0) or 0)
    return any(end >= prefix for item in mm.mm_items for _, end in item.offsets or [])


@dataclass
class Reuse:
    targets: Targets  # the request's image spans
    spans: Callable[[], SpanIndex]  # the cache's index of compressed spans
    stats: Stats
    active: bool = True
    recall: Recall | None = None  # host copies on

    def match(self, match: Callable[[], None], req) -> None:
        """Run SGLang's prefix match (``match()``) with the request's known images rewritten to
        their compressed ids; keep the rewrite for the spans the tree fully holds, undo the rest.

        Waiting requests are matched again every round. Which spans to rewrite is decided again only
        when the span index or the host copies changed since the request's last decision
        (``SpanIndex.epoch``: a span added, evicted or re-compressed; ``HostCopies.epoch``),
        or when it is planned for recall (the plan is set on the match's result); otherwise
        the request keeps the ids that decision left and only SGLang's own match runs, as
        for any request. A new decision starts from the original ids (idempotent) and leaves
        either a consistent rewrite or the original request.
        """
        index = self.spans()
        state = state_of(req)
        eligible = not (not self.active or req.kv.holds_kv or req.is_retracted
                        or full_kv_only(req))
        epoch = (index.epoch, self.recall.copies.epoch if self.recall is not None else 0)
        if eligible and state.matched == epoch and state.recall is None:
            match()
            return
        self.undo(req)
        if not req.retracted_stain:
            state.reused = 0  # SGLang counts cached_tokens at the first prefill only
        if not eligible:
            match()  # a retracted request is prefilled again from its own tokens
            return
        state.matched = epoch
        covered = self._decide(match, req, index)
        if covered and encodes_past_reused_spans(req):
            self.undo(req)
            state.matched = epoch
            match()
            return
        if self.recall is not None and self.recall.decide(req):
            return
        self.stats.spans_reused += covered

    def _decide(self, match: Callable[[], None], req, index: SpanIndex) -> int:
        """The device decision: rewrite, match, keep what the tree holds; the spans it reuses."""
        # SGLang matches at most the prompt's length - 1 (one token must be computed); a span
        # past that cap would be cut in the middle, so it is not rewritten.
        limit = len(req.origin_input_ids) - 1
        choices: dict[int, list[tuple[int, ...]]] = {}  # span start -> ids to try, newest first
        candidates = []
        for start, end, pad in self.targets.image_spans(req):
            options = index.id_choices((namespace(req), pad, start, end - start))
            if options and end <= limit:
                choices[start] = options
                candidates.append(SpanRewrite(start, end, options[0]))
        best: tuple[int, list[SpanRewrite]] | None = None  # (prompt reach, spans) so far
        tries = 0
        while candidates:
            record = rewrite(req, candidates)
            match()
            # A span HiCache holds only in host memory counts: admission loads it back.
            matched = req.prefix_len + req.host_hit_length
            removed_before, covered = 0, []
            for span in candidates:
                if matched < span.start - removed_before + len(span.ids):
                    break
                covered.append(span)
                removed_before += span.removed
            if covered == candidates:
                # Every copy of the first image is a different prefix for the turns after it
                # (another question's, or an earlier turn of this chat): the one reaching
                # furthest into the prompt (in the ids the user sent) keeps the most of them.
                reach = matched + record.removed
                tries += 1
                first = candidates[0]
                options = choices[first.start]
                at = options.index(first.ids) + 1
                if best is None or reach > best[0]:
                    best = (reach, list(candidates))
                    if at >= len(options) or tries >= MAX_COPIES_TRIED:
                        return self._keep(req, record)
                restore(req, record)
                if at >= len(options) or tries >= MAX_COPIES_TRIED:
                    break
                candidates = [SpanRewrite(first.start, first.end, options[at]), *candidates[1:]]
                continue
            restore(req, record)
            # The tree matched up to the first span it does not hold under these ids: try that
            # image's next cached copy (another prefix's, or another request's plan), else stop
            # before it.
            missed = candidates[len(covered)]
            options = choices[missed.start]
            at = options.index(missed.ids) + 1
            if at < len(options):
                candidates[len(covered)] = SpanRewrite(missed.start, missed.end, options[at])
            elif best is not None:
                break
            else:
                candidates = covered
        if best is not None:
            record = rewrite(req, best[1])
            match()
            return self._keep(req, record)
        match()
        return 0

    @staticmethod
    def _keep(req, record) -> int:
        state = state_of(req)
        state.rewrites = [record]
        state.reused = record.removed  # usage: cached tokens as the user sent them
        return len(record.spans)

    @staticmethod
    def undo(req) -> None:
        """Back to the ids, offsets and positions the user sent (every rewrite, newest first)."""
        state = state_of(req)
        for record in reversed(state.rewrites):
            restore(req, record)
        state.rewrites = []
        state.matched = None
        state.recall = None
