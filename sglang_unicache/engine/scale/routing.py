"""Data-parallel routing by image: a request goes to the replica that holds its image.

SGLang's DP controller routes round robin, so with ``--dp-size 2`` two questions about one image
land on different replicas and the image is encoded and compressed twice, and never reused. Each
replica has its own radix tree; the compressed span lives in the one that compressed it.

``ImageAffinity`` picks a replica for a request with images: the replica its first image was sent
to before (remembered, least recently used first out), or else the one its hash names, unless that
replica took ``slack`` more of the last ``window`` image requests than the least loaded one (then
the least loaded one, and it owns the image from then on): one hot image cannot starve the
other replicas. The key is the image's content hash with the request's ``cache_salt`` and
``extra_key`` (tenants that do not share a cache do not share a replica either). Requests without
images, and requests that name ``routed_dp_rank`` themselves, keep SGLang's routing.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict, deque
from dataclasses import dataclass, field

KEEP = 65536  # images remembered


@dataclass
class ImageAffinity:
    ranks: int
    slack: int = 4
    window: int = 64
    owner: OrderedDict = field(default_factory=OrderedDict)  # key -> rank
    recent: deque = field(default_factory=deque)  # ranks of the last ``window`` dispatches

    def pick(self, key: tuple, active: list[int]) -> int:
        """The replica for an image ``key`` among the ``active`` ranks."""
        rank = self.owner.get(key)
        if rank is None or rank not in active:
            rank = active[stable_hash(key) % len(active)]
        load = {r: 0 for r in active}
        for r in self.recent:
            if r in load:
                load[r] += 1
        least = min(active, key=lambda r: (load[r], r))
        if load[rank] - load[least] > self.slack:
            rank = least
        self.owner[key] = rank
        self.owner.move_to_end(key)
        while len(self.owner) > KEEP:
            self.owner.popitem(last=False)
        self.recent.append(rank)
        while len(self.recent) > self.window:
            self.recent.popleft()
        return rank


def stable_hash(key: tuple) -> int:
    """The same on every run (Python's ``hash`` of a tuple holding None is not)."""
    salt, extra, digest = key
    return digest ^ zlib.crc32(f"{salt}|{extra}".encode())


def image_key(req) -> tuple | None:
    """(cache_salt, extra_key, content hash of the first image) of a tokenized request, or None
    when it carries no image."""
    mm = getattr(req, "mm_inputs", None)
    items = getattr(mm, "mm_items", None) if mm is not None else None
    if not items:
        return None
    item = items[0]
    digest = item.hash
    if digest is None:
        from sglang.srt.managers.mm_utils import hash_feature

        digest = hash_feature(item.feature if item.feature is not None
                              else item.precomputed_embeddings)
    return (getattr(req, "cache_salt", None), getattr(req, "extra_key", None), int(digest))
