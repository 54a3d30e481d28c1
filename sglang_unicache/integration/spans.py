"""What the radix cache knows about each cached compressed span (issue 5).

A compressed span is keyed in the tree by K token ids derived from the image, its position, the
config and K itself (``Controller.compressed_ids``), so spans of different budgets never share an
id and the radix tree never splits one (its first id is unique, and no other key contains a
prefix of it). ``SpanMeta`` is the span's node metadata: original length, the source position
each entry holds per layer and KV head, merge groups, alignment-protected positions, method,
budget, self-check result and selection priorities (what re-compression under pressure reads).
The tree core attaches it to the node holding the span (``radix_cache.py``); ``SpanIndex`` finds
it from an image (for match-time rewrites).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

Namespace = tuple[object, object]  # (extra_key, cache_salt): the tree's namespace
ImageKey = tuple[Namespace, int, int, int]  # (namespace, image pad id, span start, span length)


@dataclass
class SpanMeta:
    namespace: Namespace
    pad: int
    start: int  # the span's position in the original prompt
    length: int  # N, image tokens before compression
    ids: tuple[int, ...]  # the K token ids keying the span in the tree
    kept: torch.Tensor  # [L, H, K] int32 source position (span-relative) of each entry
    priority: torch.Tensor  # [L, H, K] float32 selection priority of each entry
    protected: torch.Tensor  # [P] int64 alignment-protected source positions (every layer/head)
    merged: torch.Tensor | None  # [L, H, N] int16 entry each source folded into (-1 evicted)
    method: str
    keep_ratio: float
    selfcheck: dict | None = None
    recompressions: int = 0
    slots: torch.Tensor | None = field(default=None, repr=False)  # K slots when registered

    @property
    def image_key(self) -> ImageKey:
        return (self.namespace, self.pad, self.start, self.length)

    @property
    def count(self) -> int:
        return len(self.ids)

    def protected_entries(self) -> int:
        """The most protected entries any (layer, head) holds: the floor of a re-compression."""
        if self.protected.numel() == 0:
            return 0
        hit = torch.isin(self.kept, self.protected.to(self.kept.dtype))
        return int(hit.sum(-1).max())

    def shrink(self, keep: torch.Tensor, ids: tuple[int, ...]) -> None:
        """Keep entries ``keep`` (``[L, H, K']`` indices into the current K) under ``ids``."""
        keep = keep.to(torch.int64)
        if self.merged is not None:
            # Renumber surviving entries; sources folded into dropped entries become evicted.
            remap = torch.full(self.priority.shape, -1, dtype=torch.int64)
            remap.scatter_(-1, keep, torch.arange(keep.shape[-1]).expand_as(keep).contiguous())
            merged = self.merged.to(torch.int64)
            renumbered = remap.gather(-1, merged.clamp_min(0))
            self.merged = torch.where(merged >= 0, renumbered, -1).to(torch.int16)
        self.kept = self.kept.gather(-1, keep)
        self.priority = self.priority.gather(-1, keep)
        self.ids = ids
        self.recompressions += 1


@dataclass
class SpanIndex:
    """The spans the radix tree holds, by image: what a later request rewrites its image to. (A
    span's key stays its image when re-compression changes its ids; the tree finds spans by
    node.) An entry lives exactly as long as the node that holds its span: the radix cache
    drops it when it evicts the node or is flushed (``radix_cache.py``)."""

    by_image: dict[ImageKey, SpanMeta] = field(default_factory=dict)

    def add(self, meta: SpanMeta) -> None:
        self.by_image[meta.image_key] = meta

    def discard(self, meta: SpanMeta) -> None:
        if self.by_image.get(meta.image_key) is meta:
            del self.by_image[meta.image_key]

    def clear(self) -> None:
        self.by_image.clear()

    def of_image(self, key: ImageKey) -> SpanMeta | None:
        return self.by_image.get(key)

    def __len__(self) -> int:
        return len(self.by_image)
