"""What the radix cache knows about each cached compressed span, and the one place span ids are
derived.

A compressed span is keyed in the tree by K token ids derived from the image, its position, the
config, K itself and, for query-dependent methods, the request that chose it (``SpanNaming.ids``),
so spans of different budgets never share an id and the radix tree never splits one (its first id is
unique, and no other key contains a prefix of it). ``SpanMeta`` is the span's node metadata:
original length, the source position each entry holds per layer and KV head, merge groups, method,
budget, self-check result and selection priorities (what re-compression under pressure reads;
alignment-protected entries rank highest, so the priorities carry the protection).
The tree core attaches it to the node holding the span (``radix_cache.py``); ``SpanIndex`` finds
it from an image (for match-time rewrites).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import torch

Namespace = tuple[object, object]  # (extra_key, cache_salt): the tree's namespace
ImageKey = tuple[Namespace, int, int, int]  # (namespace, image pad id, span start, span length)

# Compressed span ids live where SGLang's image pad ids do: above every vocabulary
# (MM_PAD_SHIFT_VALUE), with 62 hash bits, so two different spans never start with the same id
# (the radix tree tells children apart by their first token).
COMPRESSED_ID_BASE = 1_000_000
COMPRESSED_ID_MASK = (1 << 62) - (1 << 24)  # room for 2**24 consecutive ids, below 2**63


@dataclass(frozen=True)
class SpanNaming:
    """Token ids of compressed spans under one config (``digest``: a hash of the config)."""

    digest: str

    @classmethod
    def of(cls, config) -> SpanNaming:
        text = json.dumps(config.to_dict(), sort_keys=True, default=str)
        return cls(hashlib.sha256(text.encode()).hexdigest()[:16])

    def ids(self, pad: int, start: int, count: int, variant: str = "") -> tuple[int, ...]:
        """One id per kept entry, the same for the same image at the same position under the
        same config, budget and ``variant`` (the request, for a query-dependent selection), so
        the radix tree can share the span; a different budget (e.g. after re-compression) or
        variant gives ids that share no prefix."""
        key = f"{pad}:{start}:{self.digest}:{count}:{variant}".encode()
        digest = int.from_bytes(hashlib.sha256(key).digest()[:8], "big")
        base = COMPRESSED_ID_BASE + (digest & COMPRESSED_ID_MASK)
        return tuple(range(base, base + count))


@dataclass
class SpanMeta:
    namespace: Namespace
    pad: int
    start: int  # the span's position in the original prompt
    length: int  # N, image tokens before compression
    ids: tuple[int, ...]  # the K token ids keying the span in the tree
    kept: torch.Tensor  # [L, H, K] int32 source position (span-relative) of each entry
    priority: torch.Tensor  # [L, H, K] float32 selection priority of each entry
    merged: torch.Tensor | None  # [L, H, N] int16 entry each source folded into (-1 evicted)
    method: str
    keep_ratio: float
    selfcheck: dict | None = None
    variant: str = ""  # ``SpanNaming.ids``' variant: re-compression keeps it
    recompressions: int = 0
    host: object = None  # the key of the image's full copy in host memory (recall.py), if taken
    slots: torch.Tensor | None = field(default=None, repr=False)  # K slots when registered

    @property
    def image_key(self) -> ImageKey:
        return (self.namespace, self.pad, self.start, self.length)

    @property
    def count(self) -> int:
        return len(self.ids)

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
    node.) One image can be cached several times: under different prefixes (two system
    prompts), or once per request for query-dependent methods. Every copy is indexed, newest
    last, so evicting one leaves the others findable. An entry lives exactly as long as the node
    that holds its span: the radix cache drops it when it evicts the node or is flushed
    (``radix_cache.py``)."""

    by_image: dict[ImageKey, list[SpanMeta]] = field(default_factory=dict)
    epoch: int = 0  # bumped on every change, ids included: a waiting request's match is stale

    def add(self, meta: SpanMeta) -> None:
        copies = self.by_image.setdefault(meta.image_key, [])
        if not any(m is meta for m in copies):
            copies.append(meta)
        self.epoch += 1

    def discard(self, meta: SpanMeta) -> None:
        copies = self.by_image.get(meta.image_key, [])
        for i, m in enumerate(copies):
            if m is meta:
                del copies[i]
                if not copies:
                    del self.by_image[meta.image_key]
                self.epoch += 1
                return

    def changed(self) -> None:
        """A span's ids changed in place (re-compression)."""
        self.epoch += 1

    def clear(self) -> None:
        self.by_image.clear()
        self.epoch += 1

    def of_image(self, key: ImageKey) -> SpanMeta | None:
        """The newest cached copy of an image."""
        copies = self.by_image.get(key)
        return copies[-1] if copies else None

    def id_choices(self, key: ImageKey) -> list[tuple[int, ...]]:
        """The distinct ids an image is cached under, newest first (what a match tries)."""
        choices: list[tuple[int, ...]] = []
        for meta in reversed(self.by_image.get(key, [])):
            if meta.ids not in choices:
                choices.append(meta.ids)
        return choices

    def __len__(self) -> int:
        return sum(len(copies) for copies in self.by_image.values())
