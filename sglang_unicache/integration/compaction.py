"""Compaction: write a request's compressed spans into its slots and shorten its row.

Region map of one request's ``req_to_token`` row before and after (one span ``[s, e)``, N = e - s
tokens kept as K entries, L prompt tokens; D = N - K):

    before  | 0 .. s  text | s .. e   image (N slots) | e .. L  text |
    after   | 0 .. s  text | s .. s+K compressed      | s+K .. L-D   |
                             (the span's first K slots, rewritten)
    freed   the span's last N - K slots, returned to the allocator

Every compressible span lies past the request's tree-owned prefix (``cache_protected_len``), so
all slots touched here belong to the request alone. The K/V of each layer and head is gathered
before anything is overwritten.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_unicache.kernels.gather import write_compressed


@dataclass
class SpanResult:
    """One compressed span: where it sits and what fills its K slots per layer."""

    start: int
    end: int
    keys: list[torch.Tensor]  # per layer [K, H, D]
    values: list[torch.Tensor]

    @property
    def kept(self) -> int:
        return self.keys[0].shape[0]


@dataclass
class Compaction:
    """The new row of a request and the slots it gave back."""

    row: torch.Tensor  # [L - D] int32 new row prefix
    freed: torch.Tensor  # [D] int64 slots returned to the allocator

    @property
    def removed(self) -> int:
        return self.freed.numel()


def gather_prompt_kv(k_buffers, v_buffers, row: torch.Tensor):
    """Per layer ``[L, H, D]`` copies of the prompt's K and V (token-major, as in the pool)."""
    index = row.to(torch.int64)
    return ([k.index_select(0, index) for k in k_buffers],
            [v.index_select(0, index) for v in v_buffers])


def plan_compaction(row: torch.Tensor, spans: list[SpanResult]) -> Compaction:
    """The row after compaction and the slots it gives back (reads nothing, writes nothing)."""
    keep = torch.ones(row.shape[0], dtype=torch.bool, device=row.device)
    for span in spans:
        keep[span.start + span.kept:span.end] = False
    return Compaction(row=row[keep], freed=row[~keep].to(torch.int64))


def write_spans(row: torch.Tensor, spans: list[SpanResult], k_buffers, v_buffers) -> None:
    """Write every span's compressed K/V into its first K slots of ``row`` (the row before
    compaction)."""
    for span in spans:
        slots = row[span.start:span.start + span.kept].to(torch.int64)
        write_compressed(k_buffers, v_buffers, slots, span.keys, span.values)


def restore_spans(row: torch.Tensor, spans: list[SpanResult], keys, values, k_buffers,
                  v_buffers) -> None:
    """Undo ``write_spans`` from the prompt's K/V gathered before it (``gather_prompt_kv``)."""
    for span in spans:
        sl = slice(span.start, span.start + span.kept)
        write_compressed(k_buffers, v_buffers, row[sl].to(torch.int64),
                         [k[sl] for k in keys], [v[sl] for v in values])
