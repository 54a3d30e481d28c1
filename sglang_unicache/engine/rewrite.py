"""Rewriting a request's token ids so compressed image spans key the radix tree, and the one
place a request's and its batch's ids, offsets, M-RoPE data and lengths change.

A compressed span of N image tokens kept as K entries becomes K token ids derived from the image
(its pad id), its position and the policy config (``spans.SpanNaming``): one id per
slot, so the radix invariant "one KV slot per key token" holds and a later request with the same
image and the same config can match the span. Everything that describes the prompt moves with
the ids: the multimodal items' offsets (so a fully cached image is not encoded again), the
M-RoPE positions and delta (so later tokens keep their logical positions, ``positions.py``), and
the reported prompt length. ``restore`` undoes it exactly (retraction, failed reuse match).
Rewrites stack: a request that reuses compressed spans (one rewrite at match time) compresses its
own new images after prefill (a second one, in the coordinates the first left); they are undone
newest first.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from sglang_unicache.engine.positions import MropeBackup, restore_mrope, shift_mrope
from sglang_unicache.engine.request import state_of


@dataclass(frozen=True)
class SpanRewrite:
    start: int  # original position of the span's first token
    end: int  # original position past its last token
    ids: tuple[int, ...]  # the K ids that replace it

    @property
    def removed(self) -> int:
        return self.end - self.start - len(self.ids)


@dataclass
class Rewrite:
    """What ``rewrite`` changed on a request."""

    spans: tuple[SpanRewrite, ...]
    origin_input_ids: array
    offsets: list
    mrope: MropeBackup | None
    removed_before: int = 0  # the request's ``removed`` before this rewrite (rewrites stack)

    @property
    def removed(self) -> int:
        return sum(span.removed for span in self.spans)


def _new_position(position: int, spans: tuple[SpanRewrite, ...]) -> int:
    return position - sum(s.removed for s in spans if s.end <= position)


def _remap_offsets(offsets, spans: tuple[SpanRewrite, ...]):
    """An item's inclusive runs after the rewrite: a compressed span becomes one run of its K
    ids (runs it joined, see ``request.merge_runs``, fold into it); other runs shift."""
    out = []
    for start, end in offsets:
        span = next((s for s in spans if s.start <= start < s.end), None)
        new_start = _new_position(start, spans)
        if span is None:
            out.append((new_start, _new_position(end + 1, spans) - 1))
        elif span.start == start:
            out.append((new_start, new_start + len(span.ids) - 1))
    return out


def rewrite(req, spans: list[SpanRewrite]) -> Rewrite:
    """Replace each span's ids by its compressed ids; returns how to undo it."""
    spans = tuple(sorted(spans, key=lambda s: s.start))
    ids = req.origin_input_ids
    pieces, cursor = [], 0
    keep = torch.ones(len(ids), dtype=torch.bool)
    for span in spans:
        pieces += ids[cursor:span.start]
        pieces += span.ids
        keep[span.start + len(span.ids):span.end] = False
        cursor = span.end
    pieces += ids[cursor:]
    mm = req.multimodal_inputs
    if hasattr(req, "get_mm_token_counts"):
        req.get_mm_token_counts()  # usage counts the images as sent: count before the offsets move
    offsets = [list(item.offsets or []) for item in mm.mm_items]
    new_offsets = [_remap_offsets(o, spans) if o else o for o in offsets]  # before any change
    state = state_of(req)
    record = Rewrite(spans, ids, offsets, shift_mrope(mm, keep, int((~keep).sum())),
                     state.removed)
    for item, remapped in zip(mm.mm_items, new_offsets, strict=True):
        if item.offsets:
            item.offsets = remapped
    req.origin_input_ids = array("q", pieces)
    req.full_untruncated_fill_ids = req.origin_input_ids + array("q", req.output_ids)
    state.removed = record.removed_before + record.removed  # the prompt's real length
    return record


def restore(req, record: Rewrite) -> None:
    mm = req.multimodal_inputs
    for item, offsets in zip(mm.mm_items, record.offsets, strict=True):
        if item.offsets:
            item.offsets = offsets
    restore_mrope(mm, record.mrope)
    req.origin_input_ids = record.origin_input_ids
    req.full_untruncated_fill_ids = req.origin_input_ids + array("q", req.output_ids)
    state_of(req).removed = record.removed_before


def original_position(position: int, records: list[Rewrite]) -> int:
    """A position in a request's current ids (after every rewrite in ``records``, oldest first)
    as a position in the prompt the user sent (a position past each compressed span it follows)."""
    for record in reversed(records):
        shift = 0
        for span in record.spans:  # sorted by start, in the coordinates before this rewrite
            if span.start - shift + len(span.ids) <= position:
                shift += span.removed
        position += shift
    return position


def shorten(req, batch, index: int, removed: int) -> None:
    """Every length of the request (batch entry ``index``) and of its batch, ``removed`` entries
    shorter (compaction; the new batch tensors are built first, so nothing is assigned unless
    all of them could be). ``batch`` None: the request is in no batch (``parking.py``)."""
    shorter = {}
    for name in ("seq_lens", "seq_lens_cpu", "orig_seq_lens") if batch is not None else ():
        lens = getattr(batch, name, None)
        if lens is not None:
            shorter[name] = lens.clone()
            shorter[name][index] -= removed
    for name, lens in shorter.items():
        setattr(batch, name, lens)
    if batch is not None and getattr(batch, "seq_lens_sum", None) is not None:
        batch.seq_lens_sum -= removed
    req.extend_end -= removed
    req.kv.kv_committed_len -= removed
    req.kv.kv_allocated_len -= removed
