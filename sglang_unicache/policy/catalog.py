"""The catalog of named parts and methods. Each part registers itself next to its definition:

    @scorer("snapkv", needs_queries=True, query_dependent=True)   # name and capabilities
    class SnapKVScorer:                      # made a frozen dataclass by the decorator
        pool_kernel: int = 7                 # parameters are fields

    method("snapkv", scorer="snapkv", budget="uniform", reducer="evict", keeps_window=True)

A part is a frozen dataclass whose fields are its parameters (the decorator makes it one and sets
its ``name`` and capabilities); the registry builds it from the user's
``UniCacheConfig`` with ``from_config``, which copies the config fields of the same names
(``prefix`` + field name: ``@budget("pyramid", prefix="pyramid_")`` reads ``pyramid_beta`` into
``PyramidBudget.beta``). So adding a method is one file in ``scorers/`` (its scorer and its
``method`` line; the package imports every module in it), and a new user-tunable parameter is a
field of the part plus a config field. The flag's help, the config's validation of names, the tests'
method lists and the method table in ``docs/policy.md`` all read this catalog (``registry.py`` fills
it by importing the parts and builds methods from it). This module imports nothing of the library,
so any part can import it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Build = Callable[[object], object]  # UniCacheConfig -> part

SCORERS: dict[str, Build] = {}
BUDGETS: dict[str, Build] = {}
REDUCERS: dict[str, Build] = {}


@dataclass(frozen=True)
class MethodSpec:
    """A named composition of parts and selection knobs (each knob read from the config)."""

    scorer: str
    budget: str
    reducer: str
    summary: str = ""  # one line for docs/policy.md
    recent_fraction: Callable[[object], float] = lambda c: 0.0
    anchor_fraction: Callable[[object], float] = lambda c: 0.0
    protects_alignment: Callable[[object], bool] = lambda c: False
    keeps_window: bool = False


METHODS: dict[str, MethodSpec] = {}


def _add(table: dict, kind: str, name: str, entry) -> None:
    if name in table:
        raise ValueError(f"unicache {kind} {name!r} is registered twice")
    table[name] = entry


def from_config(cls: type, config: object, prefix: str = "", **given: Any) -> Any:
    """``cls(**given, name=config.<prefix + name> for every other init field of cls)``: a part
    (or ``PlanContext``) built from the user's config. A field the config lacks raises
    AttributeError, so a misspelt parameter cannot silently keep its default."""
    fields = (f.name for f in dataclasses.fields(cls) if f.init and f.name not in given)
    return cls(**given, **{name: getattr(config, prefix + name) for name in fields})


def _part(table: dict, kind: str, name: str, prefix: str, capabilities: dict[str, bool]):
    def register(cls):
        cls = dataclass(frozen=True)(cls)
        cls.name = name
        for capability, value in capabilities.items():
            setattr(cls, capability, value)
        _add(table, kind, name, lambda config: from_config(cls, config, prefix))
        return cls

    return register


def scorer(name: str, prefix: str = "", *, needs_queries: bool = False,
           query_dependent: bool = False):
    """Class decorator: make ``cls`` a frozen dataclass named ``name`` with these capabilities
    (``scorers/base.py``) and register it, built by ``from_config(cls, config, prefix)``."""
    return _part(SCORERS, "scorer", name, prefix,
                 {"needs_queries": needs_queries, "query_dependent": query_dependent})


def budget(name: str, prefix: str = "", *, needs_queries: bool = False,
           keeps_everything: bool = False):
    return _part(BUDGETS, "budget", name, prefix,
                 {"needs_queries": needs_queries, "keeps_everything": keeps_everything})


def reducer(name: str, prefix: str = "", *, merges: bool = False):
    return _part(REDUCERS, "reducer", name, prefix, {"merges": merges})


def method(name: str, **spec) -> None:
    """Register method ``name`` (``MethodSpec`` fields as keywords)."""
    _add(METHODS, "method", name, MethodSpec(**spec))
