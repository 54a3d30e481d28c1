"""The one frozen configuration of the compression policy (UniCache seed §8.1 defaults).

Every parameter of every method lives here, validated once in ``__post_init__``: a bad value raises
``ValueError`` naming the field and the allowed range. Build it from keyword arguments, a mapping
(``from_mapping``), a JSON/YAML file (``from_file``) or a named preset (``preset``, seed §8.2).

Rates vs keep ratios: the seed speaks of *compression rates* (fraction removed); the engine speaks
of ``keep_ratio`` (fraction of an image's visual KV kept). ``keep_ratio`` is the level the user
asks for; the seed's rate fields shape how that level is distributed (layers, modalities).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

QUANTIZATIONS = ("off", "int8", "int4")
HOST_COPY_FORMATS = ("int8", "exact", "off")
LAYER_FILLS = ("none", "next")
MODALITY_ALLOCATIONS = ("density", "fixed")
# The self-check's statistics (checks/selfcheck.py): those over the observation queries, in the
# order layer_stats computes them, then the question-free one.
SELFCHECK_QUERY_STATISTICS = ("kl", "kl_head", "image_mass_lost", "output_error", "key_coverage")
SELFCHECK_STATISTICS = (*SELFCHECK_QUERY_STATISTICS, "content_lost")

# Seed §8.2 scenario presets, as overrides of the §8.1 defaults. keep_ratio is never changed by a
# preset: it is the user's explicit request (see module docstring).
PRESETS: dict[str, dict[str, Any]] = {
    "default": {},
    # long video: visual rate up to 0.75-0.8, text unchanged, merge similar patches eagerly.
    "long_video": {"visual_rate": 0.8, "text_rate": 0.25, "merge_threshold": 0.75},
    # dense document QA: text rate down to 0.15-0.2, visual 0.7, stronger alignment protection.
    "document_qa": {"visual_rate": 0.7, "text_rate": 0.18, "alignment_discount": 0.4},
    # real-time chat: head merging first (threshold 0.85), token rates 5 points lower.
    "realtime_chat": {
        "head_merge": True,
        "head_merge_threshold": 0.85,
        "shallow_rate": 0.70,
        "deep_rate": 0.40,
        "visual_rate": 0.65,
        "text_rate": 0.20,
    },
}


def _unit(name: str, value: float, *, low_open: bool = False, high_open: bool = False) -> None:
    ok_low = value > 0 if low_open else value >= 0
    ok_high = value < 1 if high_open else value <= 1
    if not (isinstance(value, (int, float)) and math.isfinite(value) and ok_low and ok_high):
        lo = "(0" if low_open else "[0"
        hi = "1)" if high_open else "1]"
        raise ValueError(f"unicache config: {name} must be in {lo}, {hi}, got {value!r}")


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(
            f"unicache config: {name} must be one of {', '.join(allowed)}; got {value!r}"
        )


def _int_range(name: str, value: Any, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(
            f"unicache config: {name} must be an integer in [{low}, {high}], got {value!r}"
        )


def doc(default: Any, meaning: str = "", *, section: str | None = None) -> Any:
    """A field with its default, its one-line meaning and, on the first field of a group, the
    group's title: the configuration reference (``docs/configuration.md``, rendered by
    ``tools/config_doc.py``) is made from these, one section per group, in field order."""
    metadata = {"doc": meaning} if section is None else {"doc": meaning, "section": section}
    return dataclasses.field(default=default, metadata=metadata)


# The rungs a request's own view is planned above keep_ratio when host copies are on: on the
# bundled model's 300 long answers a view of 9 entries of 64 (one sqrt 2 rung above keep 0.1)
# answered 99.3% against 94.7% at 6 (docs/selfcheck.md, "The escalation ladder").
DEFAULT_VIEW_RUNGS = 1
# The largest share of its image a request's own view is planned at when host copies are on:
# on both trained models no view the check climbed past 0.141 answered better for it, and the
# grid model's checks climbed 30 of 192 views past it (docs/selfcheck.md, "A bound on the view").
DEFAULT_VIEW_MAX_KEEP = 0.15


@dataclass(frozen=True)
class UniCacheConfig:
    """Every policy parameter with its seed default. Shapes/units are in each field's ``doc``.

    Source: UniCache seed §8.1 (defaults), §8.2 (presets); AirCache seed (alpha); SnapKV, PyramidKV,
    H2O papers for the baselines. Fields marked "ours" have no seed value.
    """

    method: str = doc(
        "unicache", "a registered method (``registry.known_methods()``)", section="what to run"
    )
    keep_ratio: float = doc(0.1, "fraction of an image span's KV kept, (0, 1]")
    min_image_tokens: int = doc(16, "spans shorter than this are left uncompressed (ours)")
    dp_routing: bool = doc(True, "with --dp-size: a request with an image goes to the replica "
                                 "holding that image (docs/scale-out.md; false: SGLang's routing)")
    overlap_compression: bool = doc(
        False, "with SGLang's overlap scheduler: a request whose prefill compresses sits out the "
        "next batch instead of that batch waiting for its compression, so the requests already "
        "decoding meet its prefill and its compression as two steps, not one "
        "(engine/parking.py; ours)")
    preset: str = doc("default", "seed §8.2 scenario; applied by from_mapping/preset()")
    scorer: str | None = doc(
        None, "override the method's scorer (composition), None = method default"
    )
    budget: str | None = doc(None, "override the method's layer budget")
    reducer: str | None = doc(None, "override the method's reducer (evict / merge)")
    seed: int = doc(0, "random baseline seed")

    observation_window: int = doc(
        32,
        "W last prompt queries the engine captures (SnapKV default 32)",
        section="observation window / attention statistics",
    )
    stats_chunk: int = doc(
        8192, "key columns per statistics chunk; peak temp Hq*W*chunk*4 B (ours)"
    )
    pool_kernel: int = doc(7, "SnapKV max-pool kernel over tokens (odd)")

    w_attention: float = doc(
        0.4, section="UniCache importance s = w_a a + w_c c - w_d d + w_r r (seed §4.2, §2.3)"
    )
    w_cross: float = 0.3
    w_redundancy: float = 0.2
    w_recency: float = 0.1
    layer_dependent_weights: bool = doc(True, "seed §4.3: shallow w_d up, deep w_a up")
    shallow_w_redundancy: float = 0.3
    deep_w_attention: float = 0.5
    redundancy_window: int = doc(4, "k neighbours each side, seed §4.2 says 4-8")
    # Query robustness (ours, docs/method.md): blend of question-dependent attention with
    # question-independent saliency (low key norm). Defaults from the reuse benchmark
    # (BENCHMARKS.md): the first question's attention alone served later questions best at every
    # keep ratio (0.6 / 0.05 cost 5-9 points).
    query_weight: float = doc(1.0, "1.0 = purely driven by the first question (the seed's formula)")
    anchor_fraction: float = doc(0.0, "fraction of each budget on evenly spaced spatial anchors")

    head_merge: bool = doc(
        False,
        "off in the engine path: cannot shrink an MHA pool (docs/policy.md)",
        section="head merging (seed §3)",
    )
    head_merge_threshold: float = 0.88

    shallow_rate: float = doc(
        0.75, "compression rate of the first layer",
        section="layer rate curve (seed §4.3; used with budget unicache)",
    )
    deep_rate: float = doc(0.45, "compression rate of the last layer")

    compress_text: bool = doc(
        False,
        "text tokens are kept unless this is on (library use only)",
        section="modality budgets (seed §5.2); used only when compress_text is on",
    )
    modality_allocation: str = doc("density", "density (seed §5.2) or fixed (visual/text_rate)")
    visual_rate: float = doc(0.70, "§8.1 visual compression rate (fixed allocation)")
    text_rate: float = doc(0.25, "§8.1 text compression rate (fixed allocation)")
    visual_rate_cap: float = 0.8
    text_rate_cap: float = 0.4

    protect_alignment: bool = doc(True, section="alignment protection (seed §5.3)")
    alignment_threshold: float = 0.3
    alignment_discount: float = 0.5
    alignment_max_share: float = doc(
        0.5, "most of a span's smallest layer budget protection may take (ours: the rest by score)")

    merge_threshold: float = doc(
        0.8, "redundancy above this -> merged into a kept entry", section="execution (seed §6)"
    )
    evict_low: float = doc(0.5, "lower edge of the evict band; also min similarity to merge")
    evict_high: float = doc(0.8, "upper edge of the evict band")
    quantization: str = doc(
        "off", "seed §8.1 says int8; off by default (SGLang pool has one dtype)"
    )
    host_quantization: str = doc(
        "off", "HiCache host copies as int8 or int4 per (slot, KV head), seed §6.3 "
        "(--enable-hierarchical-cache on the CPU platform; docs/scale-out.md)"
    )
    layer_fill: str = doc("none", '"next": pad every layer to physical_slots with next-best '
                          "tokens (the server always uses next: a pool slot spans every layer)")

    # The statistic and threshold come from docs/selfcheck.md: the seed's KL predicted best that
    # a reused compressed image answers later questions differently (AUC 0.885), and 0.9
    # separated harmed from unharmed images best; the seed's 0.1 vetoed every image.
    selfcheck: bool = doc(True, section="self-check and dynamic rate (seed §7.1, §7.2)")
    selfcheck_statistic: str = doc("kl", "what the check compares (checks/selfcheck.py)")
    selfcheck_threshold: float = doc(0.9, "above it the check fails (seed: 0.1, docs/selfcheck.md)")
    selfcheck_layers: int = doc(2, "last layers checked")
    # The question-free half of the check (checks/selfcheck.py, docs/selfcheck.md): 0.15 lies
    # midway (geometric) between UniCache's plans on the bundled model (at most 0.087, keep 0.05)
    # and on the grid model at the escalation cap 0.4 (at least 0.277), whose later answers
    # are wrong; every threshold from 0.025 to 0.25 gives UniCache the same verdicts (ours).
    selfcheck_content_threshold: float = doc(
        0.15, "content_lost above it fails the check too; 1 turns it off (docs/selfcheck.md)")
    # What decides costs less than the record of every statistic: with the KL deciding and
    # content_lost off (host copies), output_error, key_coverage and content_lost were a fifth
    # of UniCache's plan of a 4 x 1,024-token request (BENCHMARKS.md, "Overhead").
    selfcheck_all_statistics: bool = doc(
        False, "compute every statistic of the check for /server_info's recent_checks, not only "
        "those that decide")
    # A failed check multiplies the keep ratio by escalate_factor up to this cap (re-planned
    # from the same scores) before the request falls back to its full KV; <= keep_ratio means
    # no escalation (ours). sqrt(2), two rungs per doubling: from keep 0.1 the first rung (0.141)
    # stays within 0.15x of the image, and with host copies the KL half guards the request's own
    # decode, which 9 entries of 64 already serve (docs/selfcheck.md, "The escalation ladder").
    escalate_max_keep: float = doc(0.4, "a failed check raises keep up to this, then full KV")
    escalate_factor: float = doc(2**0.5, "a failed check multiplies keep by this (sqrt 2: "
                                 "0.1 -> 0.141 -> 0.2 -> 0.283 -> 0.4)")
    dynamic_rate: bool = doc(False, "derive the keep ratio from input complexity (§7.2)")
    complexity_lambda: float = 2.0
    dynamic_rate_min: float = 0.4
    dynamic_rate_max: float = 0.75
    complexity_low: float = doc(8.0, "complexity mapped to dynamic_rate_max (ours)")
    complexity_high: float = doc(18.0, "complexity mapped to dynamic_rate_min (ours)")

    # Before the radix cache evicts a cached compressed span, it shrinks it to this fraction of
    # its entries (lowest selection priority dropped, protected entries kept), down to a floor
    # of recompress_floor x the original span length; only a span at its floor is evicted.
    recompress: bool = doc(True, section="re-compression under memory pressure (ours)")
    recompress_factor: float = 0.5
    recompress_floor: float = 0.02

    # A compressed image's full KV stays in host memory, and a later question about it is
    # prefilled over all of it before compressing its own view (engine/recall.py). Only for
    # methods whose selection follows the question; with copies on, the self-check's
    # content_lost half is off (a later question no longer depends on this plan).
    host_copies: str = doc(
        "int8", "full KV of each compressed image kept in host memory for later questions: "
        "int8 per (token, KV head) (seed §6.3), exact (the pool's dtype) or off",
        section="host copies and recall (ours)")
    host_copy_gb: float = doc(4.0, "host memory the copies may hold, GiB per scheduler (least "
                              "recently used out first); 0 turns them off")
    keep_recalled_views: bool = doc(
        False, "a recalled question's compressed view (and its chat's history after the image) "
        "stays in the tree when it finishes; off: at rest the device holds one compressed span "
        "per image, the first question's")
    # With host copies a request's own view is transient: planned DEFAULT_VIEW_RUNGS up the
    # escalation ladder, it decodes on more entries while the span rests at keep_ratio.
    view_rungs: int | None = doc(
        None, "with host copies: the rungs of the escalation ladder above keep_ratio each "
        "request's own view is planned at (keep 0.1, 1 rung: 0.141, within 0.15x of the image); "
        "its span rests at keep_ratio. None: 1 in the server with host copies and the "
        "self-check on, else 0 (the policy alone: 0)")
    # A bound on the view instead of a guard (DEFAULT_VIEW_MAX_KEEP).
    view_max_keep: float | None = doc(
        None, "with host copies: the largest share of its image a request's own view is planned "
        "at; the ladder takes no rung above it, and a view that cannot climb decodes on what it "
        "has, unchecked (its first token saw the whole image; its span rests at keep_ratio). "
        "None: 0.15 (or keep_ratio if larger) in the server with host copies, else no bound; "
        "0: no bound (the ladder up to escalate_max_keep, then full KV)")
    rest_at_keep_ratio: bool = doc(
        True, "once no request uses it, a span the self-check escalated goes back to "
        "keep_ratio x N entries when its image has a host copy (the copy serves later "
        "questions); off: it keeps the escalated count")

    aircache_alpha: float = doc(0.9, section="AirCache (ICCV 2025) and baselines")
    aircache_floor: float = doc(0.1, "added to normalised layer scores before rescaling (ours)")
    pyramid_beta: float = doc(20.0, "PyramidKV: top layer gets average/beta")
    h2o_recent_fraction: float = doc(0.5, "H2O: share of the budget for recent tokens")

    def __post_init__(self) -> None:
        from sglang_unicache.policy.registry import (
            known,  # the catalog of parts (it imports this module)
        )

        _choice("method", self.method, tuple(known("method")))
        if not (0 < self.keep_ratio <= 1):
            raise ValueError(
                f"unicache config: keep_ratio must be in (0, 1], got {self.keep_ratio!r}"
            )
        _int_range("min_image_tokens", self.min_image_tokens, 1, 1 << 30)
        _choice("preset", self.preset, tuple(PRESETS))
        if self.scorer is not None:
            _choice("scorer", self.scorer, tuple(known("scorer")))
        if self.budget is not None:
            _choice("budget", self.budget, tuple(known("budget")))
        if self.reducer is not None:
            _choice("reducer", self.reducer, tuple(known("reducer")))
        _int_range("seed", self.seed, 0, 2**62)
        _int_range("observation_window", self.observation_window, 1, 1 << 20)
        _int_range("stats_chunk", self.stats_chunk, 16, 1 << 24)
        _int_range("pool_kernel", self.pool_kernel, 1, 255)
        if self.pool_kernel % 2 == 0:
            raise ValueError(f"unicache config: pool_kernel must be odd, got {self.pool_kernel}")
        for name in (
            "w_attention",
            "w_cross",
            "w_redundancy",
            "w_recency",
            "shallow_w_redundancy",
            "deep_w_attention",
            "query_weight",
            "head_merge_threshold",
            "shallow_rate",
            "deep_rate",
            "visual_rate",
            "text_rate",
            "visual_rate_cap",
            "text_rate_cap",
            "alignment_threshold",
            "alignment_discount",
            "alignment_max_share",
            "merge_threshold",
            "evict_low",
            "evict_high",
            "aircache_alpha",
            "aircache_floor",
            "h2o_recent_fraction",
            "recompress_floor",
        ):
            _unit(name, getattr(self, name))
        _unit("recompress_factor", self.recompress_factor, low_open=True, high_open=True)
        _unit("anchor_fraction", self.anchor_fraction, high_open=True)
        _choice("selfcheck_statistic", self.selfcheck_statistic, SELFCHECK_STATISTICS)
        if not (math.isfinite(self.selfcheck_threshold) and self.selfcheck_threshold > 0):
            raise ValueError(
                "unicache config: selfcheck_threshold must be > 0, got "
                f"{self.selfcheck_threshold!r}"
            )
        _unit("escalate_max_keep", self.escalate_max_keep, low_open=True)
        if self.view_rungs is not None:
            _int_range("view_rungs", self.view_rungs, 0, 64)
        if self.view_max_keep is not None:
            _unit("view_max_keep", self.view_max_keep)
        if not (isinstance(self.escalate_factor, (int, float))
                and math.isfinite(self.escalate_factor) and self.escalate_factor > 1):
            raise ValueError(
                "unicache config: escalate_factor must be > 1, got "
                f"{self.escalate_factor!r}"
            )
        _unit("selfcheck_content_threshold", self.selfcheck_content_threshold)
        _int_range("redundancy_window", self.redundancy_window, 1, 64)
        _int_range("selfcheck_layers", self.selfcheck_layers, 1, 1 << 10)
        _choice("modality_allocation", self.modality_allocation, MODALITY_ALLOCATIONS)
        _choice("quantization", self.quantization, QUANTIZATIONS)
        _choice("host_quantization", self.host_quantization, QUANTIZATIONS)
        _choice("host_copies", self.host_copies, HOST_COPY_FORMATS)
        if not (isinstance(self.host_copy_gb, (int, float)) and math.isfinite(self.host_copy_gb)
                and self.host_copy_gb >= 0):
            raise ValueError(
                f"unicache config: host_copy_gb must be >= 0, got {self.host_copy_gb!r}")
        _choice("layer_fill", self.layer_fill, LAYER_FILLS)
        if self.view_max_keep and self.view_max_keep < self.keep_ratio:
            raise ValueError(
                f"unicache config: view_max_keep ({self.view_max_keep}) must be >= keep_ratio "
                f"({self.keep_ratio}): a view is never planned below the keep ratio"
            )
        if self.evict_low > self.evict_high:
            raise ValueError(
                f"unicache config: evict_low ({self.evict_low}) must be <= evict_high "
                f"({self.evict_high})"
            )
        _unit("dynamic_rate_min", self.dynamic_rate_min, high_open=True)
        _unit("dynamic_rate_max", self.dynamic_rate_max, high_open=True)
        if self.dynamic_rate_min > self.dynamic_rate_max:
            raise ValueError(
                "unicache config: dynamic_rate_min must be <= dynamic_rate_max, got "
                f"[{self.dynamic_rate_min}, {self.dynamic_rate_max}]"
            )
        if not (self.complexity_lambda >= 0 and math.isfinite(self.complexity_lambda)):
            raise ValueError(
                f"unicache config: complexity_lambda must be >= 0, got {self.complexity_lambda!r}"
            )
        if not self.complexity_low < self.complexity_high:
            raise ValueError(
                "unicache config: complexity_low must be < complexity_high, got "
                f"{self.complexity_low} and {self.complexity_high}"
            )
        if not (self.pyramid_beta >= 1 and math.isfinite(self.pyramid_beta)):
            raise ValueError(
                f"unicache config: pyramid_beta must be >= 1, got {self.pyramid_beta!r}"
            )

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def known_keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> UniCacheConfig:
        """Build from a mapping; a ``preset`` key is applied first, other keys override it."""
        if not isinstance(data, Mapping):
            raise ValueError(f"unicache config must be a mapping, got {type(data).__name__}")
        known = cls.known_keys()
        for key in data:
            if key not in known:
                raise ValueError(
                    f"unknown unicache config key {key!r}; known keys: {', '.join(known)}"
                )
        preset = data.get("preset", "default")
        _choice("preset", preset, tuple(PRESETS))
        merged = {**PRESETS[preset], **dict(data)}
        return cls(**merged)

    @classmethod
    def from_file(cls, path: str | Path) -> UniCacheConfig:
        """Load a JSON (``.json``) or YAML (``.yaml``/``.yml``) file holding one mapping."""
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as exc:
            raise ValueError(f"cannot read unicache config file {str(p)!r}: {exc}") from exc
        suffix = p.suffix.lower()
        if suffix not in (".json", ".yaml", ".yml"):
            raise ValueError(f"unicache config file {str(p)!r} must end in .json, .yaml or .yml")
        try:
            if suffix == ".json":
                data = json.loads(text)
            else:
                import yaml

                data = yaml.safe_load(text)
        except Exception as exc:  # json.JSONDecodeError, yaml.YAMLError, ImportError
            raise ValueError(f"cannot parse unicache config file {str(p)!r}: {exc}") from exc
        return cls.from_mapping(data or {})

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> UniCacheConfig:
        """The §8.2 preset ``name`` with optional overrides."""
        return cls.from_mapping({"preset": name, **overrides})

    def replace(self, **overrides: Any) -> UniCacheConfig:
        """A copy with some fields changed (validated again); unknown names raise ValueError."""
        known = self.known_keys()
        for key in overrides:
            if key not in known:
                raise ValueError(
                    f"unknown unicache config key {key!r}; known keys: {', '.join(known)}"
                )
        return dataclasses.replace(self, **overrides)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # -- derived values --------------------------------------------------------------------------
    def span_budget(self, span_len: int) -> int:
        """K = max(1, round(keep_ratio * span_len)), never above span_len."""
        return min(span_len, max(1, round(self.keep_ratio * span_len)))


class _PresetAccessor:
    """``UniCacheConfig.preset(name)`` on the class; the ``preset`` field value on an instance.

    A non-data descriptor: an instance's own ``preset`` attribute (set by ``__init__``) wins over
    it, so only class-level access reaches ``__get__``.
    """

    def __get__(self, instance: object, owner: type[UniCacheConfig]) -> Any:
        if instance is not None:  # pragma: no cover - instance __dict__ normally wins
            return instance.__dict__["preset"]
        return owner.from_preset


UniCacheConfig.preset = _PresetAccessor()  # type: ignore[assignment]
