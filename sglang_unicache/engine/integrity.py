"""``check_integrity``: the slot and span invariants the plugin relies on, checked.

Every KV slot of the pool (every page, in a paged pool: the allocator hands out and takes back
whole pages) is in exactly one place:

    free     the allocator's free and release lists
    tree     a radix-tree node's value (shared; requests that matched it only read it)
    request  a live request's row past what the tree holds (its own, not yet in the tree)

No slot is in two places and their sum is the pool size (nothing leaked, nothing freed twice).
Every compressed span's metadata is attached to a live tree node (on the device, or only in
HiCache's host tier) whose key holds the span's ids, and the image index (what later requests
are rewritten to) names only such spans. A span waiting to go back to the keep ratio at rest
(``CompressedRadixCache.resting``) is one a request still uses.

It returns the violations as one-line strings (empty when all hold) so that a test can assert on
them through ``/server_info`` and a server keeps running when one is found.
"""

from __future__ import annotations

import torch

from sglang_unicache.engine.radix_cache import FULL, spans_of


def live_requests(scheduler) -> list:
    """Every request holding a row: running, waiting, the chunked one, and (overlap scheduler)
    those of a batch in flight, whose result is not processed yet: a request finishing there has
    left the running batch and still holds its row until the result frees it."""
    in_flight = [req for batch, _ in scheduler.result_queue for req in batch.reqs]
    reqs = {}
    for req in [*scheduler.running_batch.reqs, *scheduler.waiting_queue, *in_flight,
                *([scheduler.chunked_req] if scheduler.chunked_req is not None else [])]:
        if req.kv.req_pool_idx is not None:
            reqs[req.rid] = req
    return list(reqs.values())


def _duplicates(slots: torch.Tensor) -> int:
    return int(slots.numel() - torch.unique(slots).numel())


def check_integrity(scheduler) -> list[str]:
    """The violations found (one line each); never raises (it runs inside ``/server_info``)."""
    try:
        return _check(scheduler)
    except Exception as exc:  # a bug here must not take the scheduler down
        return [f"check_integrity failed: {type(exc).__name__}: {exc}"]


def _check(scheduler) -> list[str]:
    allocator = scheduler.token_to_kv_pool_allocator
    tree = scheduler.tree_cache
    size = getattr(allocator, "page_size", 1)  # counted in pages: a paged pool frees whole ones
    unit = "slot" if size == 1 else "page"
    errors = []
    free = allocator.get_all_free_pages().to(torch.int64).cpu()
    held = (tree.all_values_flatten().to(torch.int64).cpu() if hasattr(tree, "all_values_flatten")
            else torch.empty(0, dtype=torch.int64))
    if _duplicates(free):
        errors.append(f"{_duplicates(free)} {unit}(s) twice in the free list")
    if _duplicates(held):
        errors.append(f"{_duplicates(held)} slot(s) held by two tree nodes")
    held_pages = torch.unique(held // size)
    if held_pages.numel() * size != held.numel():
        errors.append(f"the tree holds {held.numel()} slots, not whole pages of {size}")
    both = torch.isin(free, held_pages)
    if both.any():
        errors.append(f"{int(both.sum())} {unit}(s) both free and in the tree")
    owned = []
    req_to_token = scheduler.req_to_token_pool.req_to_token
    for req in live_requests(scheduler):
        row = req_to_token[req.kv.req_pool_idx, :req.kv.kv_allocated_len]
        row = row.to(torch.int64).cpu()
        own = torch.unique(row[~torch.isin(row, held)] // size)
        if torch.isin(own, free).any():
            errors.append(f"request {req.rid} holds {int(torch.isin(own, free).sum())} free "
                          f"{unit}(s)")
        if torch.isin(own, held_pages).any():
            errors.append(f"request {req.rid} owns {int(torch.isin(own, held_pages).sum())} "
                          f"{unit}(s) of the tree")
        owned.append(own)
    owned = torch.cat(owned) if owned else torch.empty(0, dtype=torch.int64)
    if _duplicates(owned):
        errors.append(f"{_duplicates(owned)} {unit}(s) owned by two requests")
    requests = torch.unique(owned).numel()
    total = free.numel() + held_pages.numel() + requests
    pages = allocator.size // size
    if total != pages:
        errors.append(f"{pages - total} {unit}(s) leaked: free {free.numel()} + tree "
                      f"{held_pages.numel()} + requests {requests} != pool "
                      f"{pages}" + (f" (pages of {size} slots)" if size > 1 else ""))
    errors += _check_spans(tree)
    return errors


def _check_spans(tree) -> list[str]:
    if getattr(tree, "settings", None) is None:  # not the plugin's radix cache, or spans off
        return []
    errors, attached = [], set()
    for node in tree.tree_core._node_arena.values():
        spans = spans_of(node)
        if not spans:
            continue
        ids = list(node.key.raw_token_ids())
        for first, meta in spans.items():
            if node.component(FULL).value is None and not node.backuped:
                errors.append(f"span {first} attached to an evicted node")
            at = ids.index(first) if first in ids else -1
            if at < 0 or ids[at:at + meta.count] != list(meta.ids):
                errors.append(f"span {first}: the node's key does not hold its {meta.count} ids")
            attached.add(id(meta))
    if tree.compressed_slots_held() != tree.count_held():
        errors.append(f"compressed_slots_held {tree.compressed_slots_held()} != the "
                      f"{tree.count_held()} the nodes' spans hold")
    if tree.host.spans != tree.count_on_host():
        errors.append(f"spans_on_host {tree.host.spans} != the {tree.count_on_host()} host-only "
                      "nodes' spans")
    unused = tree.resting_unused()
    if unused:
        errors.append(f"{unused} escalated span(s) with a host copy unused and not back at "
                      "the keep ratio")
    indexed = {id(m) for copies in tree.spans.by_image.values() for m in copies}
    stale = indexed - attached
    if stale:
        errors.append(f"{len(stale)} indexed span(s) belong to no tree node")
    lost = attached - indexed
    if lost:
        errors.append(f"{len(lost)} cached span(s) are not indexed: no request can find them")
    return errors

