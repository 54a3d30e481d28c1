"""The shape of the policy layer: its import graph has no cycles and never points upwards, every
module imports on its own, and every part's parameters are its own fields with the config's
defaults (the registry copies them from ``UniCacheConfig``; no part reads the config)."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_unicache.budgets.modality import ModalityBudget
from sglang_unicache.catalog import from_config
from sglang_unicache.checks.dynamic_rate import DynamicRate
from sglang_unicache.checks.selfcheck import SelfCheck
from sglang_unicache.config import UniCacheConfig
from sglang_unicache.context import PlanContext
from sglang_unicache.registry import BUDGETS, REDUCERS, SCORERS

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "sglang_unicache"

# Bottom to top: a module imports only from lower ranks (and its own subpackage).
RANKS = [
    {"catalog", "config", "serial", "shrink", "kernels"},
    {"inputs", "heads", "signals", "ranks"},
    {"plans"},
    {"context", "quantize"},
    {"executor"},
    {"policies", "budgets", "reducers", "checks"},  # the parts
    {"compressor"},
    {"registry"},
    {"press"},  # the transformers entry point: builds methods by name
]
# The parts are peers; two of them use another's code, never the other way round.
PEER_USES = {
    ("budgets", "policies"),  # the AirCache budget reads the AirCache scorer's elite window
}
RANK = {unit: i for i, units in enumerate(RANKS) for unit in units}


def policy_modules() -> list[str]:
    """Every module of the policy layer (the package minus the engine side)."""
    mods = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        if rel.parts[1].removesuffix(".py") in RANK:
            mods.append(".".join(rel.parts).removesuffix(".__init__"))
    return mods


def module_imports(name: str) -> set[str]:
    """``sglang_unicache`` modules (and ``sglang``) imported at module level, TYPE_CHECKING
    blocks included, lazy imports inside functions not."""
    path = ROOT / (name.replace(".", "/") + ".py")
    if not path.exists():
        path = ROOT / name.replace(".", "/") / "__init__.py"
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()

    def visit(body) -> None:
        for node in body:
            if isinstance(node, ast.If):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([base] if base else []))
                out.add(base)
                if not node.module:  # from . import x
                    out.update(f"{base}.{a.name}" for a in node.names)

    visit(ast.parse(path.read_text()).body)
    return {m for m in out if m.split(".")[0] in ("sglang", "sglang_unicache")}


def unit(module: str) -> str:
    return module.split(".")[1].removesuffix(".py") if "." in module else ""


@pytest.mark.parametrize("name", policy_modules())
def test_imports_point_downwards(name: str) -> None:
    mine = unit(name)
    for dep in module_imports(name):
        assert dep.split(".")[0] != "sglang", (
            f"{name} imports {dep}: the policy layer is pure torch"
        )
        theirs = unit(dep)
        if theirs in ("", mine):
            continue
        ok = RANK[theirs] < RANK[mine] or (mine, theirs) in PEER_USES
        assert ok, f"{name} imports {dep}: {theirs} is not below {mine}"


def test_every_module_imports_on_its_own() -> None:
    """Each module imported first, in a fresh package: an import cycle would fail here."""
    names = [n for n in policy_modules() if n != "sglang_unicache.kernels.window_score"]
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    for m in [m for m in sys.modules if m.split('.')[0] == 'sglang_unicache']:\n"
        "        del sys.modules[m]\n"
        "    importlib.import_module(name)\n"
        "assert 'sglang' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_parts_are_built_with_their_own_defaults() -> None:
    """Built from the default config, every registered part equals the part with its own
    defaults: each part's defaults are the config's and ``from_config`` found every field."""
    cfg = UniCacheConfig()
    for table in (SCORERS, BUDGETS, REDUCERS):
        for name, build in table.items():
            part = build(cfg)
            assert dataclasses.is_dataclass(part), name
            assert part == type(part)(), name
    for cls, prefix in ((ModalityBudget, ""), (SelfCheck, "selfcheck_"), (DynamicRate, "")):
        assert from_config(cls, cfg, prefix) == cls()
    for f in dataclasses.fields(PlanContext):
        if f.init and f.name not in ("inputs", "shards"):  # not settings: the request, the ranks
            assert f.default == getattr(cfg, f.name), f.name


def test_a_config_field_reaches_its_part() -> None:
    cfg = UniCacheConfig(w_cross=0.7, pyramid_beta=5.0, aircache_alpha=0.5, evict_low=0.3)
    assert SCORERS["unicache"](cfg).w_cross == 0.7
    assert BUDGETS["pyramid"](cfg).beta == 5.0
    assert SCORERS["aircache"](cfg).alpha == BUDGETS["aircache"](cfg).alpha == 0.5
    assert REDUCERS["merge"](cfg).evict_low == 0.3
