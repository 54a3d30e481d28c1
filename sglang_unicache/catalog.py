"""The catalog of named parts and methods. Each part registers itself next to its definition:

    @scorer("snapkv", lambda c: SnapKVScorer(pool_kernel=c.pool_kernel))
    @dataclass(frozen=True)
    class SnapKVScorer: ...

    method("snapkv", scorer="snapkv", budget="uniform", reducer="evict", keeps_window=True)

so adding a method is one file (its scorer and its ``method`` line) plus its import in
``policies/__init__.py``. The flag's help, the config's validation of names, the tests' method
lists and the method table in ``docs/policy.md`` all read this catalog (``registry.py`` fills it
by importing the parts and builds methods from it). This module imports nothing of the library,
so any part can import it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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


def _part(table: dict, kind: str, name: str, build: Build | None):
    def register(cls):
        _add(table, kind, name, build or (lambda config: cls()))
        return cls

    return register


def scorer(name: str, build: Build | None = None):
    """Class decorator: register a scorer; ``build(config)`` makes it (default: ``cls()``)."""
    return _part(SCORERS, "scorer", name, build)


def budget(name: str, build: Build | None = None):
    return _part(BUDGETS, "budget", name, build)


def reducer(name: str, build: Build | None = None):
    return _part(REDUCERS, "reducer", name, build)


def method(name: str, **spec) -> None:
    """Register method ``name`` (``MethodSpec`` fields as keywords)."""
    _add(METHODS, "method", name, MethodSpec(**spec))
