"""The KV pool's one owner in the plugin: every write of compressed entries into pool slots and
every slot the plugin gives back.

Writes: a request's spans after prefill (``write_spans``, undone by ``restore_slots``), a
cached span's entries when it is re-compressed (``move_entries``), and a recalled image and its
history into the slots of the request that recalls it (``write_entries``, ``copy_slots``).
Frees: ``Slots.free``, for the N - K slots of a compaction and the slots a re-compression drops; it
also clears the scheduler's "running batch is full" mark (set when a waiting request did not fit,
cleared by SGLang only when a request leaves), since the slots freed make room too.

Region map of one request's ``req_to_token`` row before and after (one span ``[s, e)``, N = e - s
tokens kept as K entries, L prompt tokens; D = N - K):

    before  | 0 .. s  text | s .. e   image (N slots) | e .. L  text |
    after   | 0 .. s  text | s .. s+K compressed      | s+K .. L-D   |
                             (the span's first K slots, rewritten)
    freed   the span's last N - K slots, returned to the allocator

Paged (``--page-size`` P > 1), each span keeps as many entries as end it on a page boundary,
the text after it moves to the pages that follow, and what is freed is whole pages
(``plan_compaction``).

Every compressible span lies past the request's tree-owned prefix (``cache_protected_len``), so
all slots touched here belong to the request alone. The K/V each write overwrites is copied first
(``backup_slots``), so a failure restores it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from sglang_unicache.policy.inputs import LayerView, page_end
from sglang_unicache.policy.kernels.scatter import as_bytes, write_compressed


@dataclass
class Slots:
    """Where the plugin's freed slots go: the allocator, and then ``on_free`` (the scheduler's
    batch-is-full reset)."""

    allocator: object
    on_free: Callable[[], None] | None = None

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        self.allocator.free(slots)
        if self.on_free is not None:
            self.on_free()


@dataclass
class SpanResult:
    """One compressed span: where it sits and what fills its K slots per layer."""

    start: int
    end: int
    keys: list[torch.Tensor]  # per layer [K, H, D]
    values: list[torch.Tensor]

    @property
    def count(self) -> int:
        """K: entries kept (one slot each)."""
        return self.keys[0].shape[0]


@dataclass
class Compaction:
    """The new row of a request, where each span's entries go, the text entries that move, and
    the slots it gives back."""

    row: torch.Tensor  # [L - D] new row prefix (the row's dtype)
    targets: list[torch.Tensor]  # per span, the K slots its entries are written into
    moves: tuple[torch.Tensor, torch.Tensor]  # (from, to) slots of text entries that move
    freed: torch.Tensor  # int64 slots returned to the allocator (whole pages)
    removed: int  # D: how much shorter the row is

    def written(self) -> torch.Tensor:
        """Every slot a write of this compaction overwrites."""
        return torch.cat([*self.targets, self.moves[1]]).to(torch.int64)


def unwritable_pool(kv_pool) -> str | None:
    """Why the pool's buffers cannot take compaction's writes, or None. A quantized pool (or any
    whose ``get_key_buffer`` builds a new tensor, e.g. dequantized) hands out copies: the writes
    would land in the copy and be lost, silently. Two reads of one layer must share storage."""
    if getattr(kv_pool, "is_quantized_kv_cache", False):
        return f"{type(kv_pool).__name__} is a quantized KV cache"
    layer = kv_pool.start_layer
    for read in (kv_pool.get_key_buffer, kv_pool.get_value_buffer):
        first, second = read(layer), read(layer)
        if first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr():
            return f"{type(kv_pool).__name__} returns a copy of its buffers"
    return None


def pool_buffers(kv_pool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer K and V buffers of this rank's layers (``[slots, H, D]`` each)."""
    layers = range(kv_pool.start_layer, kv_pool.start_layer + kv_pool.layer_num)
    return ([kv_pool.get_key_buffer(i) for i in layers],
            [kv_pool.get_value_buffer(i) for i in layers])


def move_entries(k_buffers, v_buffers, slots: torch.Tensor, keep: torch.Tensor) -> None:
    """Within a span's ``slots`` (K), move entries ``keep`` (``[L, H, K']``, per layer and head)
    to the first K' slots (re-compression, ``radix_cache.py``). Stored values move as they are
    (bytes, for a float8 pool): nothing is re-quantized."""
    index = slots.to(torch.int64)
    head = index[:keep.shape[-1]]
    for layer, (kb, vb) in enumerate(zip(k_buffers, v_buffers, strict=True)):
        pick = keep[layer].to(kb.device).t().unsqueeze(-1)  # [K', H, 1]
        for buf in (as_bytes(kb), as_bytes(vb)):
            entries = buf.index_select(0, index)  # [K, H, D]
            buf[head] = entries.gather(0, pick.expand(-1, -1, entries.shape[-1]))


def read_dtype(buffer: torch.Tensor) -> torch.dtype:
    """What a pool buffer's entries are read as: a float8 pool as bfloat16 (exact)."""
    return torch.bfloat16 if buffer.element_size() == 1 else buffer.dtype


def read_entries(buffer: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """One layer's entries at ``index`` as attention sees them (``read_dtype``)."""
    return buffer.index_select(0, index).to(read_dtype(buffer))


def prompt_kv(k_buffers, v_buffers, row: torch.Tensor) -> tuple[LayerView, LayerView]:
    """The prompt's K and V per layer (``[L, H, D]``, token-major as in the pool), gathered from
    the pool when a layer is read: the policy reads one layer at a time, so a long prompt's K/V
    is never copied for every layer at once.

    A float8 pool is read dequantized to bfloat16 (exact: every float8 value is a bfloat16 value),
    so the policy scores what attention sees and an evicted span is written back bit-exact; only
    merged entries are rounded to the pool's dtype again. SGLang's per-layer ``k_scale`` /
    ``v_scale`` (1.0 unless the checkpoint carries them) are not applied: a scalar per layer."""
    index = row.to(torch.int64)

    def view(buffers) -> LayerView:
        first = buffers[0]
        return LayerView(len(buffers), (index.numel(), *first.shape[1:]),
                         lambda layer: read_entries(buffers[layer], index),
                         read_dtype(first), first.device)

    return view(k_buffers), view(v_buffers)


def plan_compaction(row: torch.Tensor, spans: list[SpanResult], page_size: int = 1) -> Compaction:
    """The row after compaction (reads nothing, writes nothing).

    One slot a page: each span's entries go into its first K slots, the text keeps its slots,
    the span's last N - K slots are freed. Paged (``--page-size`` P): the allocator frees whole
    pages and a token at row position ``i`` must sit at offset ``i % P`` of the page its
    neighbours in ``[i - i % P, ...)`` share. The plan made each span end on a page boundary
    (``ImageSpan.stored``), so from the first span on the new row is laid out afresh: the first
    span's first page keeps its slots (the text before the span shares it), the row's next
    pages are reused in order for what follows (entries written, text moved), and the pages
    left over are freed."""
    if page_size == 1 or not spans:
        keep = torch.ones(row.shape[0], dtype=torch.bool, device=row.device)
        for span in spans:
            keep[span.start + span.count:span.end] = False
        targets = [row[s.start:s.start + s.count].to(torch.int64) for s in spans]
        empty = torch.empty(0, dtype=torch.int64, device=row.device)
        return Compaction(row[keep], targets, (empty, empty), row[~keep].to(torch.int64),
                          int((~keep).sum()))
    size, length = page_size, row.shape[0]
    removed = sum(s.end - s.start - s.count for s in spans)
    new_length = length - removed
    first = spans[0].start
    head = page_end(first, size)  # the first span's first page ends here
    pages = row[head:length:size].to(torch.int64) // size  # the row's pages past it, in order
    if new_length < head:
        raise ValueError(f"the first span keeps {spans[0].count} entries, short of its first "
                         f"page ({head - first} slots)")
    used = (page_end(new_length, size) - head) // size
    offsets = torch.arange(size, device=row.device)
    placed = (pages[:used, None] * size + offsets).reshape(-1)[:new_length - head]
    new_row = torch.cat([row[:head].to(torch.int64), placed])
    # Where each new position's entry comes from: a span's entry, or a text token's old slot.
    sources = torch.full((new_length,), -1, dtype=torch.int64, device=row.device)
    targets, at, cursor = [], first, first
    for span in spans:
        text = span.start - cursor
        sources[at:at + text] = row[cursor:span.start].to(torch.int64)
        at += text
        targets.append(new_row[at:at + span.count])
        at += span.count
        cursor = span.end
    sources[at:] = row[cursor:].to(torch.int64)
    text = sources >= 0
    text[:first] = False
    moved = text & (sources != new_row)
    freed = (pages[used:, None] * size + offsets).reshape(-1)
    return Compaction(new_row.to(row.dtype), targets, (sources[moved], new_row[moved]), freed,
                      removed)


def backup_slots(compaction: Compaction, k_buffers, v_buffers):
    """Per layer copies of the K/V the compaction's writes overwrite."""
    slots = compaction.written()
    return ([as_bytes(k).index_select(0, slots) for k in k_buffers],
            [as_bytes(v).index_select(0, slots) for v in v_buffers])


def write_spans(compaction: Compaction, spans: list[SpanResult], k_buffers, v_buffers) -> None:
    """Move the text entries the compaction moves (every one read before any write), then write
    each span's compressed K/V into its target slots."""
    source, target = compaction.moves
    if target.numel():
        copy_slots(k_buffers, v_buffers, source, target)
    for span, slots in zip(spans, compaction.targets, strict=True):
        write_compressed(k_buffers, v_buffers, slots, span.keys, span.values)


def restore_slots(compaction: Compaction, backup, k_buffers, v_buffers) -> None:
    """Undo ``write_spans`` from ``backup_slots``."""
    slots = compaction.written()
    for buffers, saved in zip((k_buffers, v_buffers), backup, strict=True):
        for buf, entries in zip(buffers, saved, strict=True):
            as_bytes(buf).index_copy_(0, slots.to(buf.device), entries)


def write_entries(k_buffers, v_buffers, slots: torch.Tensor, keys, values) -> None:
    """Write per-layer K/V (``[n, H, D]`` each) into ``slots`` (a recalled image)."""
    write_compressed(k_buffers, v_buffers, slots, keys, values)


def copy_slots(k_buffers, v_buffers, source: torch.Tensor, target: torch.Tensor) -> None:
    """Copy every layer's entries of slots ``source`` into slots ``target`` (as stored: bytes,
    for a float8 pool)."""
    source, target = source.to(torch.int64), target.to(torch.int64)
    for kb, vb in zip(k_buffers, v_buffers, strict=True):
        for buf in (as_bytes(kb), as_bytes(vb)):
            buf.index_copy_(0, target.to(buf.device), buf.index_select(0, source.to(buf.device)))
