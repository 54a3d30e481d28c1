"""Full copies of compressed images in host memory, kept for later questions (``recall.py``).

When a request compresses an image, the image's full KV (every token, layer and KV head) is kept
here first; a later request about the same image loads it back for its own prefill, so its
question attends to every image token, and then compresses its own view. One compressed copy
cannot serve questions not yet asked; a copy per question can.

A copy is keyed like the radix tree's path to the image: the tree's namespace, the image (its pad
id), its position and length, and a digest of the prompt before it (an image's KV depends on the
text it follows). It is stored as int8 codes per (token, KV head) with a bfloat16 scale (UniCache
seed §6.3; ``quantize.pack_host_rows``: 0.5 + 1/head_dim of bfloat16's bytes), or ``exact``: in
the KV pool's own dtype. The store is bounded by a byte budget, least recently used out first; a
request whose copy is gone reuses the compressed span on the device, as without host copies.

The plugin owns this store rather than HiCache's host tier: HiCache backs up whole radix nodes
(the text around the image too) keyed by their path, written through as they enter the tree,
while a host copy must exist exactly for the spans that are compressed, be taken before the
compaction overwrites them, and be loaded into the slots of one request, not into the tree.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from sglang_unicache.engine.spans import Namespace
from sglang_unicache.policy.quantize import pack_host_rows, unpack_host_rows

HostKey = tuple[Namespace, int, int, int, bytes]  # (namespace, pad, start, length, prefix digest)


def host_key(namespace: Namespace, pad: int, start: int, length: int, ids) -> HostKey:
    """The key of the image span ``[start, start + length)`` of a prompt with ids ``ids``."""
    digest = hashlib.blake2b(array("q", ids[:start]).tobytes(), digest_size=16).digest()
    return (namespace, pad, start, length, digest)


@dataclass
class HostCopy:
    keys: list[torch.Tensor]  # per layer: [N, H, row bytes] uint8 (int8) or [N, H, D] (exact)
    values: list[torch.Tensor]
    nbytes: int

    @property
    def length(self) -> int:
        return self.keys[0].shape[0]


@dataclass
class HostCounters:
    stored: int = 0  # copies taken
    evicted: int = 0  # copies dropped for the byte budget


@dataclass
class HostCopies:
    """The byte-bounded store of full image spans (one per scheduler: its own KV heads)."""

    budget: int  # bytes
    quantized: bool  # int8 rows, else the pool's dtype
    head_dim: int
    dtype: torch.dtype  # what a loaded copy is written back as (the pool's)
    copies: OrderedDict[HostKey, HostCopy] = field(default_factory=OrderedDict)
    nbytes: int = 0
    counters: HostCounters = field(default_factory=HostCounters)
    epoch: int = 0  # bumped when a copy comes or goes (waiting requests decide again)

    def __len__(self) -> int:
        return len(self.copies)

    def __contains__(self, key: HostKey) -> bool:
        return key in self.copies

    def get(self, key: HostKey) -> HostCopy | None:
        """The copy, marked most recently used (None if there is none)."""
        copy = self.copies.get(key)
        if copy is not None:
            self.copies.move_to_end(key)
        return copy

    def pack(self, layers: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each layer's ``[N, H, D]`` K or V as stored (on the host), packed in one pass over the
        layers stacked: each row is packed on its own, so the rows are those of a layer alone."""
        stacked = torch.stack([layer.detach() for layer in layers])  # a copy, never the pool
        packed = pack_host_rows(stacked, 8) if self.quantized else stacked.to(self.dtype)
        return list(packed.to("cpu").unbind(0))

    def put(self, key: HostKey, keys: list[torch.Tensor], values: list[torch.Tensor]) -> bool:
        """Keep a packed copy (``pack``'s output per layer); older copies leave for the budget.
        False when it alone is over the budget (nothing is kept)."""
        nbytes = sum(t.numel() * t.element_size() for t in (*keys, *values))
        if nbytes > self.budget:
            return False
        old = self.copies.pop(key, None)
        if old is not None:
            self.nbytes -= old.nbytes
        while self.copies and self.nbytes + nbytes > self.budget:
            _, dropped = self.copies.popitem(last=False)
            self.nbytes -= dropped.nbytes
            self.counters.evicted += 1
        self.copies[key] = HostCopy(keys, values, nbytes)
        self.nbytes += nbytes
        self.counters.stored += 1
        self.epoch += 1
        return True

    def unpack(self, stored: torch.Tensor, device) -> torch.Tensor:
        """A stored layer back as ``[N, H, D]`` in the pool's dtype, on ``device``."""
        stored = stored.to(device)
        if self.quantized:
            return unpack_host_rows(stored, self.head_dim, self.dtype)
        return stored

    def clear(self) -> None:
        self.copies.clear()
        self.nbytes = 0
        self.epoch += 1

    def check(self) -> list[str]:
        """The store's invariants, as ``check_integrity`` lines."""
        errors = []
        counted = sum(copy.nbytes for copy in self.copies.values())
        if counted != self.nbytes:
            errors.append(f"host copies hold {counted} bytes, {self.nbytes} counted")
        if self.nbytes > self.budget:
            errors.append(f"host copies hold {self.nbytes} bytes, over the {self.budget} budget")
        return errors
