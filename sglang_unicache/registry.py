"""One explicit registry of named methods and of the composable parts they are made of.

A method name maps to (scorer, budget, reducer, selection knobs). ``UniCacheConfig.scorer /
budget / reducer`` override a part, so e.g. "AirCache budget + UniCache scores + merge" is
``UniCacheConfig(method="aircache", scorer="unicache", reducer="merge")``, not a new class.
Unknown names raise ``ValueError`` listing the known ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .budgets import AirCacheBudget, FullBudget, PyramidBudget, UniCacheBudget, UniformBudget
from .budgets.base import LayerBudget
from .compressor import Method
from .config import UniCacheConfig
from .policies import (
    AirCacheScorer,
    FullScorer,
    H2OScorer,
    KNormScorer,
    RandomScorer,
    SnapKVScorer,
    UniCacheScorer,
)
from .reducers import EvictReducer, MergeReducer

SCORERS: dict[str, Callable[[UniCacheConfig], object]] = {
    "unicache": lambda c: UniCacheScorer(),
    "aircache": lambda c: AirCacheScorer(),
    "snapkv": lambda c: SnapKVScorer(pool_kernel=c.pool_kernel),
    "h2o": lambda c: H2OScorer(),
    "knorm": lambda c: KNormScorer(),
    "random": lambda c: RandomScorer(seed=c.seed),
    "full": lambda c: FullScorer(),
}
BUDGETS: dict[str, Callable[[UniCacheConfig], LayerBudget]] = {
    "uniform": lambda c: UniformBudget(),
    "unicache": lambda c: UniCacheBudget(c.shallow_rate, c.deep_rate),
    "aircache": lambda c: AirCacheBudget(c.aircache_floor),
    "pyramid": lambda c: PyramidBudget(c.pyramid_beta),
    "full": lambda c: FullBudget(),
}
REDUCERS: dict[str, Callable[[UniCacheConfig], object]] = {
    "evict": lambda c: EvictReducer(),
    "merge": lambda c: MergeReducer(),
}


@dataclass(frozen=True)
class MethodSpec:
    scorer: str
    budget: str
    reducer: str
    recent_fraction: Callable[[UniCacheConfig], float] = lambda c: 0.0
    anchor_fraction: Callable[[UniCacheConfig], float] = lambda c: 0.0
    protects_alignment: Callable[[UniCacheConfig], bool] = lambda c: False
    keeps_window: bool = False


METHODS: dict[str, MethodSpec] = {
    "unicache": MethodSpec(
        "unicache",
        "unicache",
        "merge",
        anchor_fraction=lambda c: c.anchor_fraction,
        protects_alignment=lambda c: c.protect_alignment,
    ),
    "aircache": MethodSpec("aircache", "aircache", "evict"),
    "snapkv": MethodSpec("snapkv", "uniform", "evict", keeps_window=True),
    "pyramidkv": MethodSpec("snapkv", "pyramid", "evict", keeps_window=True),
    "h2o": MethodSpec("h2o", "uniform", "evict", recent_fraction=lambda c: c.h2o_recent_fraction),
    "knorm": MethodSpec("knorm", "uniform", "evict"),
    "random": MethodSpec("random", "uniform", "evict"),
    "full": MethodSpec("full", "full", "evict"),
}


def known_methods() -> list[str]:
    return list(METHODS)


def _pick(table: dict, name: str, kind: str):
    if name not in table:
        raise ValueError(f"unknown unicache {kind} {name!r}; known: {', '.join(table)}")
    return table[name]


def build_method(config: UniCacheConfig | str) -> Method:
    """The method named by ``config.method`` (a string is taken as a method name with defaults)."""
    if isinstance(config, str):
        _pick(METHODS, config, "method")
        config = UniCacheConfig(method=config)
    spec = _pick(METHODS, config.method, "method")
    return Method(
        name=config.method,
        config=config,
        scorer=_pick(SCORERS, config.scorer or spec.scorer, "scorer")(config),
        budget=_pick(BUDGETS, config.budget or spec.budget, "budget")(config),
        reducer=_pick(REDUCERS, config.reducer or spec.reducer, "reducer")(config),
        recent_fraction=spec.recent_fraction(config),
        anchor_fraction=spec.anchor_fraction(config),
        protects_alignment=spec.protects_alignment(config),
        keeps_window=spec.keeps_window,
    )
