"""Methods by name, built from the parts the catalog holds (``catalog.py``).

A method name maps to (scorer, budget, reducer, selection knobs). ``UniCacheConfig.scorer /
budget / reducer`` override a part, so e.g. "AirCache budget + UniCache scores + merge" is
``UniCacheConfig(method="aircache", scorer="unicache", reducer="merge")``, not a new class.
Unknown names raise ``ValueError`` listing the known ones.
"""

from __future__ import annotations

from sglang_unicache.policy import budgets, reducers, scorers  # noqa: F401  (importing the parts registers them)
from sglang_unicache.policy.catalog import BUDGETS, METHODS, REDUCERS, SCORERS, MethodSpec
from sglang_unicache.policy.compressor import Method
from sglang_unicache.policy.config import UniCacheConfig

__all__ = ["BUDGETS", "METHODS", "REDUCERS", "SCORERS", "MethodSpec", "build_method",
           "known_methods"]


def known_methods() -> list[str]:
    """Every registered method, the default first."""
    return sorted(METHODS, key=lambda name: (name != "unicache", name))


def known(kind: str) -> list[str]:
    """Registered names of ``kind``: method, scorer, budget or reducer."""
    if kind == "method":
        return known_methods()
    return list({"scorer": SCORERS, "budget": BUDGETS, "reducer": REDUCERS}[kind])


def _pick(table: dict, name: str, kind: str):
    if name not in table:
        raise ValueError(f"unknown unicache {kind} {name!r}; known: {', '.join(known(kind))}")
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
