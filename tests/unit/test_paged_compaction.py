"""Compaction in a paged pool (``--page-size`` P > 1): SGLang's allocator hands out and frees
whole pages, and the token at row position ``i`` must sit at offset ``i % P`` of the page its
aligned block shares. Each span keeps as many entries as end it on a page boundary, the text
after it moves, whole pages are freed, and the row reads as it should."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("sglang")

from sglang_unicache.engine.kvpool import (  # noqa: E402
    SpanResult,
    backup_slots,
    plan_compaction,
    restore_slots,
    write_spans,
)
from sglang_unicache.policy.config import UniCacheConfig  # noqa: E402
from sglang_unicache.policy.inputs import ImageSpan  # noqa: E402
from tests.unit.test_compaction import DIM, HEADS, setup  # noqa: E402


def paged_row(pages: torch.Tensor, length: int, size: int) -> torch.Tensor:
    return (pages[:, None] * size + torch.arange(size)).reshape(-1)[:length]


def assert_paged(row: torch.Tensor, size: int) -> None:
    """Every position at its page offset, every aligned block in one page."""
    positions = torch.arange(row.numel())
    assert torch.equal(row % size, positions % size)
    blocks = row // size
    for start in range(0, row.numel(), size):
        assert blocks[start:start + size].unique().numel() == 1


def test_stored_counts_end_the_span_on_a_page_boundary():
    span = ImageSpan(13, 13 + 100, page=(16, 13))
    counts = span.stored(torch.tensor([1, 3, 10, 19, 80, 90, 99]))
    # 13 + 3 = 16, 13 + 19 = 32, 13 + 83 = 96; 90 and 99 would drop less than a page: kept whole
    assert counts.tolist() == [3, 3, 19, 19, 83, 100, 100]
    assert ((counts[:-2] + 13) % 16 == 0).all()
    assert ImageSpan(0, 8).stored(torch.tensor([5])).tolist() == [5]  # one slot a page
    with pytest.raises(ValueError, match="page needs"):
        ImageSpan(0, 8, page=(16, 16))


@pytest.mark.parametrize("size", [4, 16])
def test_the_paged_layout_keeps_every_entry_and_frees_whole_pages(size):
    g = torch.Generator().manual_seed(size)
    slots_total = 64 * size
    k_buf = [torch.randn(slots_total, HEADS, DIM, generator=g) for _ in range(2)]
    v_buf = [torch.randn(slots_total, HEADS, DIM, generator=g) for _ in range(2)]
    # 7 text, a 40-token image, 5 text, a 33-token image, 9 text
    length = 7 + 40 + 5 + 33 + 9
    pages = torch.randperm(63, generator=g)[:-(-length // size)] + 1
    row = paged_row(pages, length, size).to(torch.int32)
    spans = []
    boundary = 0
    for start, n in ((7, 40), (52, 33)):
        span = ImageSpan(start, start + n, page=(size, (start - boundary) % size))
        k = int(span.stored(torch.tensor([5])))
        spans.append(SpanResult(start, start + n,
                                [torch.randn(k, HEADS, DIM, generator=g) for _ in range(2)],
                                [torch.randn(k, HEADS, DIM, generator=g) for _ in range(2)]))
        boundary = start + n
    before_k = [b.clone() for b in k_buf]
    compaction = plan_compaction(row, spans, size)
    backup = backup_slots(compaction, k_buf, v_buf)
    write_spans(compaction, spans, k_buf, v_buf)

    new = compaction.row.to(torch.int64)
    assert new.numel() == length - compaction.removed
    assert_paged(new, size)
    new_pages, freed_pages = set((new // size).tolist()), set((compaction.freed // size).tolist())
    assert not new_pages & freed_pages
    assert new_pages | freed_pages == set(pages.tolist())
    assert compaction.freed.numel() == len(freed_pages) * size  # whole pages
    # Each span ends on a page boundary of the new row; its entries and the text are where the
    # new row says.
    at, cursor, expected = 0, 0, []
    for span in spans:
        expected += [("text", i) for i in range(cursor, span.start)]
        expected += [("entry", span, j) for j in range(span.count)]
        at += span.start - cursor + span.count
        assert at % size == 0
        cursor = span.end
    expected += [("text", i) for i in range(cursor, length)]
    assert len(expected) == new.numel()
    for layer in range(2):
        for position, what in enumerate(expected):
            got = k_buf[layer][new[position]]
            want = (before_k[layer][row[what[1]].long()] if what[0] == "text"
                    else what[1].keys[layer][what[2]])
            assert torch.equal(got, want), (layer, position, what[0])
    restore_slots(compaction, backup, k_buf, v_buf)
    assert all(torch.equal(a, b) for a, b in zip(k_buf, before_k, strict=True))


def test_one_slot_a_page_is_the_layout_it_always_was():
    row = torch.arange(100, 150, dtype=torch.int32)
    spans = [SpanResult(5, 25, [torch.zeros(4, HEADS, DIM)], [torch.zeros(4, HEADS, DIM)])]
    compaction = plan_compaction(row, spans)
    assert torch.equal(compaction.row, torch.cat([row[:9], row[25:]]))
    assert torch.equal(compaction.targets[0], row[5:9].long())
    assert torch.equal(compaction.freed, row[9:25].long()) and compaction.removed == 16
    assert compaction.moves[0].numel() == 0


SIZE, START, N, LENGTH = 16, 13, 100, 130  # a 100-token image at 13..112, pages of 16


def test_a_paged_request_compacts_to_whole_pages():
    controller, req, _, allocator, _ = setup(
        torch.tensor([LENGTH]), config=UniCacheConfig(method="knorm", keep_ratio=0.1,
                                                      selfcheck=False),
        page_size=SIZE, shape=(START, N, LENGTH))
    free = allocator.available_size()
    controller.on_checkpoint(req)
    assert controller.stats.images_compressed == 1 and controller.stats.errors == 0
    kept = N - (LENGTH - req.extend_end)
    assert kept >= 10 and (START + kept) % SIZE == 0  # the image ends on a page boundary
    assert req.multimodal_inputs.mm_items[0].offsets == [(START, START + kept - 1)]
    row = controller.req_to_token[1, :req.extend_end].to(torch.int64)
    assert_paged(row, SIZE)
    pages_before, pages_after = -(-LENGTH // SIZE), -(-req.extend_end // SIZE)
    assert allocator.available_size() == free + (pages_before - pages_after) * SIZE
    assert controller.stats.slots_freed == (pages_before - pages_after) * SIZE
