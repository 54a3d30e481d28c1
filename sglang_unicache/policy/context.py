"""PlanContext: one request's inputs plus lazily computed, cached per-layer signals.

Scorers, budgets, reducers and checks all read signals from here, so a signal (e.g. the window
attention of layer 7) is computed once per plan however many components use it. Every signal is a
per-layer ``[H, T]`` fp32 tensor unless stated otherwise. Nothing here modifies the inputs.

The context's own settings are its fields (the compressor copies them from ``UniCacheConfig``);
a part's parameters are fields of the part, never read from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from sglang_unicache.policy import signals
from sglang_unicache.policy.heads import apply_head_merge, plan_head_merge
from sglang_unicache.policy.inputs import ImageSpan, ScoreInputs
from sglang_unicache.policy.kernels import window_colsum, window_lse
from sglang_unicache.policy.kernels.reference import (
    WINDOW_SIGNALS,
    causal_logits,
    colsum_from_logits,
    lse_from_logits,
    window_signals,
)
from sglang_unicache.policy.ranks import ONE_RANK, HeadShards

Tensor = torch.Tensor


@dataclass
class PlanContext:
    """Inputs + settings + caches for one ``plan`` call (defaults: ``UniCacheConfig``'s).

    stats_chunk: key columns per chunk of the window statistics (above it no full logits are
        kept). redundancy_window: neighbours each side of the redundancy signal (seed §4.2).
    head_merge, head_merge_threshold: merge KV heads whose cosine reaches the threshold before any
        signal is computed (seed §3). compress_text: text runs get a plan too. shards: how the
        KV heads are split over tensor-parallel ranks (``policy/ranks.py``); every head average that
        decides a plan's shape goes through it.

    segments: the spans that get a plan (image spans, plus text runs when ``compress_text``).
    is_visual: ``[T]`` bool, token in any image span. run_id: ``[T]`` int, id of the maximal
    same-modality run (image spans and text runs), used to keep neighbour windows inside a run.
    """

    inputs: ScoreInputs
    stats_chunk: int = 8192
    redundancy_window: int = 4
    head_merge: bool = False
    head_merge_threshold: float = 0.88
    compress_text: bool = False
    shards: HeadShards = ONE_RANK
    _cache: dict[tuple[str, int], Any] = field(default_factory=dict, init=False, repr=False)
    _logits: dict[int, Tensor] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        inp = self.inputs
        t = inp.num_tokens
        dev = inp.device
        self.is_visual = torch.zeros(t, dtype=torch.bool, device=dev)
        self.run_id = torch.zeros(t, dtype=torch.long, device=dev)
        bounds = sorted({0, t, *(s.start for s in inp.spans), *(s.end for s in inp.spans)})
        for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
            self.run_id[a:b] = i
        for s in inp.spans:
            self.is_visual[s.start : s.end] = True
        self.text_mask = ~self.is_visual
        segs: list[ImageSpan] = list(inp.spans)
        if self.compress_text:
            segs += [
                ImageSpan(a, b, "text")
                for a, b in zip(bounds, bounds[1:], strict=False)
                if not self.is_visual[a]
            ]
        self.segments = sorted(segs, key=lambda s: s.start)
        if inp.obs_queries is not None:
            self.obs_positions = inp.obs_positions.to(dev)
            self.query_is_text = self.text_mask[self.obs_positions]
        else:
            self.obs_positions = None
            self.query_is_text = None

    # -- basic facts -----------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.inputs.num_layers

    @property
    def has_queries(self) -> bool:
        return self.inputs.obs_queries is not None

    def cached(self, name: str, layer: int, fn):
        """Compute ``fn()`` once per (name, layer) for this plan and return the stored value."""
        key = (name, layer)
        if key not in self._cache:
            self._cache[key] = fn()
        return self._cache[key]

    def has(self, name: str, layer: int) -> bool:
        """Whether ``cached(name, layer, ...)`` is already computed."""
        return (name, layer) in self._cache

    def store(self, name: str, layer: int, value) -> None:
        """Keep a signal computed elsewhere (``policy/stacked.py``: several layers at once) as
        ``cached(name, layer, ...)`` would have computed it."""
        self._cache[(name, layer)] = value

    # -- K/V after head merging (seed §3: merge heads first, then score tokens) -------------------
    def head_clusters(self, layer: int) -> tuple[Tensor, Tensor] | None:
        """``(head_map [H], head_weight [H])`` or None when head merging is off."""
        if not self.head_merge:
            return None
        return self.cached(
            "head_merge",
            layer,
            lambda: plan_head_merge(
                self.inputs.keys[layer], self.inputs.values[layer], self.head_merge_threshold
            ),
        )

    def keys(self, layer: int) -> Tensor:
        hm = self.head_clusters(layer)
        if hm is None:
            return self.inputs.keys[layer]
        return self.cached("keys", layer, lambda: apply_head_merge(self.inputs.keys[layer], *hm))

    def values(self, layer: int) -> Tensor:
        hm = self.head_clusters(layer)
        if hm is None:
            return self.inputs.values[layer]
        return self.cached(
            "values", layer, lambda: apply_head_merge(self.inputs.values[layer], *hm)
        )

    # -- observation-window attention ----------------------------------------------------------
    def require_queries(self, who: str) -> None:
        if not self.has_queries:
            raise ValueError(f"{who} needs observation queries (ScoreInputs.obs_queries)")

    def logits(self, layer: int) -> Tensor | None:
        """Causal logits ``[H, G, W, T]`` of the layer's observation queries, computed once and
        kept for the two most recent layers; None when T exceeds ``stats_chunk`` (then every
        statistic is computed chunk by chunk instead)."""
        if self.inputs.num_tokens > self.stats_chunk:
            return None
        if layer not in self._logits:
            self.keep_logits(layer, causal_logits(
                self.inputs.obs_queries[layer],
                self.keys(layer),
                self.inputs.scale,
                self.obs_positions,
            ))
        return self._logits[layer]

    def keep_logits(self, layer: int, logits: Tensor) -> None:
        """Keep ``logits`` as the layer's (the two latest layers are kept)."""
        if len(self._logits) >= 2:
            self._logits.pop(next(iter(self._logits)))
        self._logits[layer] = logits

    def window_lse(
        self, layer: int, col_mask: Tensor | None = None, rows: slice | None = None
    ) -> Tensor:
        """``[H, G, W']`` softmax normalisers of (a slice of) the observation queries."""
        lg = self.logits(layer)
        rows = slice(None) if rows is None else rows
        if lg is not None:
            return lse_from_logits(lg[:, :, rows], col_mask)
        return window_lse(
            self.inputs.obs_queries[layer][rows],
            self.keys(layer),
            self.inputs.scale,
            self.obs_positions[rows],
            col_mask,
            self.stats_chunk,
        )

    def window_colsum(
        self,
        layer: int,
        lse: Tensor,
        col_mask: Tensor | None = None,
        row_weight: Tensor | None = None,
        rows: slice | None = None,
    ) -> Tensor:
        """``[H, T]`` attention received, summed over group heads and weighted queries."""
        lg = self.logits(layer)
        rows = slice(None) if rows is None else rows
        if lg is not None:
            return colsum_from_logits(lg[:, :, rows], lse, col_mask, row_weight)
        return window_colsum(
            self.inputs.obs_queries[layer][rows],
            self.keys(layer),
            self.inputs.scale,
            self.obs_positions[rows],
            lse,
            col_mask,
            row_weight,
            self.stats_chunk,
        )

    def lse(self, layer: int, mask_name: str = "all") -> Tensor:
        """``[H, G, W]`` log-normalisers over all visible keys ("all") or visual keys ("visual")."""
        col = None if mask_name == "all" else self.is_visual
        return self.cached(f"lse_{mask_name}", layer, lambda: self.window_lse(layer, col))

    @property
    def group(self) -> int:
        return self.inputs.obs_queries[0].shape[1] // self.inputs.num_kv_heads

    def _window(self, layer: int, name: str, chunked) -> Tensor:
        """The window signal ``name`` of the layer: with its logits kept, every scorer signal
        at once (``window_signals``: ``received``, ``received_text``, ``visual_share``);
        otherwise ``chunked()``, chunk by chunk over the keys."""
        if not self.has(name, layer):
            lg = self.logits(layer)
            if lg is None:
                return self.cached(name, layer, chunked)
            signals_ = window_signals(lg, self.is_visual, self.query_is_text)
            for n, value in zip(WINDOW_SIGNALS, signals_, strict=True):
                self.store(n, layer, value)
        return self._cache[(name, layer)]

    def received(self, layer: int) -> Tensor:
        """Mean attention each key receives from the W observation queries (and group heads)."""
        return self._window(layer, "received", lambda: self.window_colsum(
            layer, self.lse(layer)) / (self.obs_positions.numel() * self.group))

    def received_from_text(self, layer: int) -> Tensor:
        """Mean attention each key receives from the observation queries that are text tokens."""

        def chunked() -> Tensor:
            rw = self.query_is_text.float()
            out = self.window_colsum(layer, self.lse(layer), row_weight=rw)
            return out / (rw.sum().clamp_min(1.0) * self.group)

        return self._window(layer, "received_text", chunked)

    def visual_share(self, layer: int) -> Tensor:
        """``[H, W]``: fraction of each observation query's attention that lands on image tokens."""
        return self._window(layer, "visual_share", lambda: torch.exp(
            self.lse(layer, "visual") - self.lse(layer)).nan_to_num(0.0).mean(dim=1))

    # -- question-independent signals ----------------------------------------------------------
    def redundancy(self, layer: int) -> Tensor:
        """Seed §4.2 d_i ``[H, T]``: neighbours in raster order, or on the patch grid for spans
        that carry ``ImageSpan.grid`` (rows, cols) with a length divisible by cols."""

        def fn() -> Tensor:
            x, win = self.unit_kv(layer), self.redundancy_window
            d = signals.raster_redundancy(x, self.run_id, win)
            for s in self.inputs.spans:  # per image, not per token
                if s.grid is not None and s.length % s.grid[1] == 0:
                    sl = slice(s.start, s.end)
                    d[:, sl] = signals.patch_grid_redundancy(x[sl], s.grid[1], win)
            return d

        return self.cached("redundancy", layer, fn)

    def unit_kv(self, layer: int) -> Tensor:
        """``[T, H, 2D]`` fp32 unit keys and values (``signals.unit_kv``), shared by the
        redundancy signal and the merge reducer's nearest-entry search. The key norms computed
        on the way are kept as ``key_norm``."""

        def fn() -> Tensor:
            x, norms = signals.unit_kv_norms(self.keys(layer), self.values(layer))
            self.cached("key_norm", layer, lambda: norms[..., 0].T.contiguous())
            return x

        return self.cached("unit_kv", layer, fn)

    def key_norm(self, layer: int) -> Tensor:
        """``[H, T]`` fp32 L2 norm of each key."""
        return self.cached(
            "key_norm", layer, lambda: self.keys(layer).float().norm(dim=-1).T.contiguous()
        )

    def recency(self) -> Tensor:
        """``[T]`` position inside its run, scaled to [0, 1] (last token of a run = 1)."""
        return self.cached("recency", -1, lambda: signals.run_position(self.run_id))
