"""The plugin's side of one scheduler: its parts, built once, and the calls the hooks make.

A request with an image, in the order the scheduler meets it (``docs/architecture.md`` walks it
in full):

1. waiting, before prefix matching: ``match_with_reuse`` (``reuse.py``) rewrites its known
   images to the compressed spans the tree holds;
2. before an extend batch runs: ``begin_forward`` (``targets.py``) picks the requests that
   compress their own images and marks their observation rows for query capture;
3. before its KV enters the tree: ``on_checkpoint`` (``compress.py``) plans, self-checks,
   writes and compacts, and frees N - K slots per image (``kvpool.Slots``);
4. retracted: ``on_retract`` restores the ids the user sent (it is prefilled and compressed
   again).

With host copies (``recall.py``), step 3 also keeps the full KV of the request's first image in
host memory, and step 1 plans a later request about that image for recall: SGLang's admission
loads the image back into the request's own slots, its prefill sees every image token, and step
3 compresses its own view.

Counters are ``stats.py``'s; self-check outcomes and the fallback warning ``outcomes.py``'s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from sglang_unicache.engine.capture import QueryCapture
from sglang_unicache.engine.compress import Compression
from sglang_unicache.engine.host_copies import HostCopies
from sglang_unicache.engine.kvpool import Slots
from sglang_unicache.engine.outcomes import Outcomes
from sglang_unicache.engine.parking import Parking
from sglang_unicache.engine.radix_cache import SpanSettings
from sglang_unicache.engine.recall import Recall
from sglang_unicache.engine.request import state_of
from sglang_unicache.engine.reuse import Reuse
from sglang_unicache.engine.scale.tensor_parallel import TensorParallel
from sglang_unicache.engine.spans import SpanIndex, SpanNaming
from sglang_unicache.engine.stats import Stats
from sglang_unicache.engine.targets import Targets
from sglang_unicache.policy.config import (
    DEFAULT_VIEW_MAX_KEEP,
    DEFAULT_VIEW_RUNGS,
    UniCacheConfig,
)
from sglang_unicache.policy.keep import KeepRatio
from sglang_unicache.policy.quantize import host_row_bytes
from sglang_unicache.policy.registry import build_method

logger = logging.getLogger("sglang_unicache")

_NO_SPANS = SpanIndex()  # without a radix cache nothing is reused


@dataclass
class Controller:
    config: UniCacheConfig
    req_to_token: torch.Tensor
    kv_pool: object
    allocator: object
    metrics: object | None = None  # metrics.Metrics with --enable-metrics
    # radix_cache.CompressedRadixCache, unless the radix cache is off: it owns the cached spans'
    # metadata and the index by image (what a later request's ids are rewritten to).
    tree: object | None = None
    mrope: bool = True  # positions through M-RoPE data (Qwen2-VL); else a 1-D offset per request
    dp_rank: int = 0  # which data-parallel replica this scheduler is (/server_info shows it)
    tp: TensorParallel = field(default_factory=TensorParallel)  # --tp-size: the ranks agree
    on_slots_freed: Callable[[], None] | None = None  # the scheduler's batch-is-full reset
    stats: Stats = field(default_factory=Stats)
    parking: Parking | None = None  # overlap_compression on, in a loop that allows it

    def __post_init__(self) -> None:
        # A slot spans every layer, so every layer keeps the same number of entries: layers whose
        # budget is smaller are filled with their next-best tokens. The config kept (and shown
        # in /server_info) is the one in effect.
        self.config = cfg = self.config.replace(layer_fill="next")
        self.method = build_method(cfg)
        self.active = cfg.method != "full" and cfg.keep_ratio < 1.0
        copies = self._host_copies()
        # With host copies a later question recalls the full image: content_lost, a guess about
        # questions not yet asked, no longer guards anything (docs/selfcheck.md), and each
        # request's own view starts on the self-check's ladder a rung above keep_ratio (its span
        # rests at keep_ratio), climbing no higher than view_max_keep; with the check off it is
        # planned at keep_ratio unless view_rungs says otherwise. Without copies a span rests at
        # the count it was planned at: the view is the span later questions share, so it is
        # planned at keep_ratio and its ladder is unbounded.
        rungs = cfg.view_rungs
        if rungs is None:
            rungs = DEFAULT_VIEW_RUNGS if cfg.selfcheck else 0
        bound = cfg.view_max_keep
        if bound is None:
            bound = max(DEFAULT_VIEW_MAX_KEEP, cfg.keep_ratio)
        wanted = ({"selfcheck_content_threshold": 1.0, "view_rungs": rungs,
                   "view_max_keep": bound}
                  if copies is not None else {"view_rungs": 0, "view_max_keep": 0.0})
        if any(getattr(cfg, key) != value for key, value in wanted.items()):
            self.config = cfg = cfg.replace(**wanted)
            self.method = build_method(cfg)
        if self.active and cfg.selfcheck:
            logger.info("sglang-unicache: %s at keep %.3g; %s", cfg.method, cfg.keep_ratio,
                        _ladder_line(cfg, self.method.keep))
        self.naming = SpanNaming.of(cfg)
        self.slots = Slots(self.allocator, self.on_slots_freed)
        self.outcomes = Outcomes(cfg, self.stats)
        self.targets = Targets(cfg, self.stats, self.active)
        self.compression = Compression(self.method, self.naming, self.req_to_token, self.kv_pool,
                                       self.slots, self.tp, self.stats, self.outcomes,
                                       page_size=self.page_size)
        self.recall = (Recall(copies, self.targets, self.kv_pool, self.stats,
                              cfg.keep_recalled_views, page_size=self.page_size)
                       if copies is not None else None)
        self.compression.recall = self.recall
        self.reuse = Reuse(self.targets, lambda: self.spans, self.stats, self.active,
                           self.recall)
        if self.tree is not None:
            self.tree.enable_spans(SpanSettings(self.naming, cfg.recompress, self.method.keep),
                                   self.slots, self.recall)

    def _host_copies(self) -> HostCopies | None:
        """The host store of full images (None: off, or of no use to this method), and the
        startup line saying what it may hold."""
        cfg = self.config
        if not self.active or self.tree is None or cfg.host_copies == "off" \
                or cfg.host_copy_gb <= 0:
            return None
        if not self.method.query_dependent:
            logger.info("sglang-unicache: host copies off: %s keeps the same entries whatever "
                        "the question, so a later question gains nothing from the full image",
                        cfg.method)
            return None
        pool = self.kv_pool
        dtype = torch.bfloat16 if pool.dtype.itemsize == 1 else pool.dtype  # as prompt_kv reads
        quantized = cfg.host_copies == "int8"
        copies = HostCopies(int(cfg.host_copy_gb * 2**30), quantized, pool.head_dim, dtype)
        row = host_row_bytes(pool.head_dim, 8) if quantized else pool.head_dim * dtype.itemsize
        per_token = 2 * pool.layer_num * pool.head_num * row
        logger.info("sglang-unicache: host copies on: up to %.3g GiB of host memory per "
                    "scheduler (%s, %d bytes per image token, %.2fx the bfloat16 KV); a later "
                    "question about a compressed image is prefilled over all of it",
                    cfg.host_copy_gb, cfg.host_copies, per_token,
                    row / (2 * pool.head_dim))
        return copies

    @property
    def page_size(self) -> int:
        return getattr(self.allocator, "page_size", 1)

    @property
    def spans(self) -> SpanIndex:
        return self.tree.spans if self.tree is not None else _NO_SPANS

    # -- the calls the hooks make, in a request's order -------------------------------------------
    def match_with_reuse(self, match: Callable[[], None], req) -> None:
        self.reuse.match(match, req)

    def begin_forward(self, batch) -> QueryCapture | None:
        return self.targets.begin_forward(batch)

    def defer_chunk_checkpoint(self, req) -> bool:
        return self.targets.defer_chunk_checkpoint(req)

    def prefills_for_compression(self) -> bool:
        return self.targets.prefills_for_compression()

    def park_targets(self, batch) -> None:
        """With ``overlap_compression``: the compression targets of the extend batch now running
        sit out the next build (``parking.py``), unless any of them cannot (then they are
        compressed at once)."""
        if self.parking is None:
            return
        targets = [req for req in batch.reqs if self.targets.is_target(req)]

        def take(req):
            pending, capture = self.targets.take(req)
            pending.batch = None  # out of that batch from the next build on: only req shrinks
            return pending, capture

        self.parking.park(targets, take)

    def parks(self, req) -> bool:
        """Whether ``req`` is parked: its compression waits for the build after next."""
        return self.parking is not None and self.parking.holds(req)

    def compresses(self, req) -> bool:
        """Whether ``req``'s checkpoint compresses (it is a target of the batch in flight, or
        a parked one)."""
        return self.targets.is_target(req) or self.parks(req)

    def on_checkpoint(self, req) -> None:
        taken = self.targets.take(req)
        if taken is None and self.parking is not None:
            taken = self.parking.take(req)
        if taken is not None:
            self.compression.run(req, *taken)

    def on_retract(self, req) -> None:
        self.stats.retracted += 1
        self.reuse.undo(req)
        state_of(req).fresh = None

    # -- what the user reads -----------------------------------------------------------------------
    def integrity_errors(self) -> list[str]:
        """The controller's own findings, as ``check_integrity`` lines: tensor-parallel
        agreement, and the host copies' store and loads."""
        n = self.stats.rank_disagreements
        errors = [f"{n} compression(s) differed between tensor-parallel ranks"] if n else []
        errors += self.parking.check() if self.parking is not None else []
        return errors + (self.recall.check() if self.recall is not None else [])

    def gauges(self) -> dict[str, float]:
        held = self.tree.compressed_slots_held() if self.tree is not None else 0
        host = self.tree.host.spans if self.tree is not None else 0
        copies = self.recall.gauges() if self.recall is not None \
            else {"host_copies": 0, "host_copy_bytes": 0}
        return {"compressed_slots_held": held, "spans_on_host": host, **copies}

    def publish(self) -> None:
        """Counters and gauges to ``/metrics`` (with ``--enable-metrics``)."""
        if self.metrics is not None:
            self.metrics.sync(self.counters(), self.gauges())

    def counters(self) -> dict[str, float]:
        shrunk = self.tree.recompressed if self.tree is not None else None
        host = self.tree.host if self.tree is not None else None
        return {**self.stats.to_dict(),
                "requests_parked": self.parking.parked_total if self.parking else 0,
                "spans_recompressed": shrunk.spans if shrunk else 0,
                "recompress_slots_freed": shrunk.slots_freed if shrunk else 0,
                "spans_shrunk_at_rest": shrunk.at_rest if shrunk else 0,
                "spans_loaded_back": host.loaded_back if host else 0,
                "load_back_waits": host.load_back_waits if host else 0,
                **(self.recall.counters() if self.recall is not None
                   else {"host_copies_stored": 0, "host_copies_evicted": 0})}

    def snapshot(self) -> dict:
        return {"dp_rank": self.dp_rank, **self.counters(), **self.gauges(),
                "available_slots": int(self.allocator.available_size()),
                "radix_cache": type(self.tree).__name__ if self.tree is not None else None,
                "method": self.config.method, "keep_ratio": self.config.keep_ratio,
                "config": self.config.to_dict(),
                "recent_checks": list(self.outcomes.recent_checks)}


def _ladder_line(cfg: UniCacheConfig, keep: KeepRatio) -> str:
    """The startup line's account of the self-check: what it checks and where its ladder ends."""
    start, top = keep.start(), keep.top()
    if keep.bounded and start >= top:
        return (f"each request's own view at keep {start:.3g} (view_max_keep "
                f"{cfg.view_max_keep:.3g}), the top of its ladder: decoded unchecked")
    then = "decoding on that view" if keep.bounded else "keeping full KV"
    return (f"self-check {cfg.selfcheck_statistic} <= {cfg.selfcheck_threshold:.3g} and "
            f"content_lost <= {cfg.selfcheck_content_threshold:.3g}, escalating up to keep "
            f"{top:.3g} before {then}")
