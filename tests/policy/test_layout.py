"""The shape of the package: every module in a layer folder that imports only the layers below it,
the policy layer's import graph without cycles and never pointing upwards, every policy module
importing on its own, and every part's parameters are its own fields with the config's
defaults (the registry copies them from ``UniCacheConfig``; no part reads the config)."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_unicache.policy.budgets.modality import ModalityBudget
from sglang_unicache.policy.catalog import from_config
from sglang_unicache.policy.checks.dynamic_rate import DynamicRate
from sglang_unicache.policy.checks.selfcheck import SelfCheck
from sglang_unicache.policy.config import UniCacheConfig
from sglang_unicache.policy.context import PlanContext
from sglang_unicache.policy.keep import KeepRatio
from sglang_unicache.policy.registry import BUDGETS, REDUCERS, SCORERS

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "sglang_unicache"

# The package's folders and what each may import of the package (its own folder always) and
# whether it may import SGLang. Every module lives in one of them.
LAYERS = {
    "policy": (set(), False),  # pure torch
    "engine": ({"policy", "platform"}, True),  # the plugin: with the platform, the SGLang importers
    "adapters": ({"policy"}, False),  # the methods on a plain transformers model
    "client": (set(), False),  # the router client: nothing of torch or SGLang
    "platform": ({"policy"}, True),  # the out-of-tree CPU platform (its host copies quantize)
}

# Inside policy/, bottom to top: a module imports only from lower ranks (and its own subpackage).
RANKS = [
    {"catalog", "config", "serial", "shrink", "keep", "kernels"},
    {"inputs", "heads", "signals", "ranks"},
    {"plans"},
    {"context", "quantize", "stacked"},
    {"executor"},
    {"scorers", "budgets", "reducers", "checks"},  # the parts
    {"compressor"},
    {"registry"},
]
# The parts are peers; two of them use another's code, never the other way round.
PEER_USES = {
    ("budgets", "scorers"),  # the AirCache budget reads the AirCache scorer's elite window
}
RANK = {unit: i for i, units in enumerate(RANKS) for unit in units}


def package_modules(folder: str | None = None) -> list[str]:
    """Every module of the package (or of one of its folders), dotted."""
    mods = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        if folder is None or (len(rel.parts) > 2 and rel.parts[1] == folder):
            mods.append(".".join(rel.parts).removesuffix(".__init__"))
    return mods


def policy_modules() -> list[str]:
    return package_modules("policy")


def module_imports(name: str) -> set[str]:
    """Top-level packages and ``sglang_unicache`` modules imported at module level,
    TYPE_CHECKING blocks included, lazy imports inside functions not."""
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
    return out


def folder(module: str) -> str:
    """The package folder a dotted module lives in ("" for the package's own ``__init__``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else ""


def unit(module: str) -> str:
    """A policy module's unit: ``sglang_unicache.policy.budgets.base`` -> ``budgets``."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 else ""


def test_every_module_lives_in_a_layer_folder() -> None:
    loose = [m for m in package_modules() if m != "sglang_unicache" and folder(m) not in LAYERS]
    assert not loose, f"modules outside {sorted(LAYERS)}: {loose}"


@pytest.mark.parametrize("name", [m for m in package_modules() if folder(m) in LAYERS])
def test_each_folder_imports_only_what_its_layer_may(name: str) -> None:
    mine = folder(name)
    allowed, may_import_sglang = LAYERS[mine]
    for dep in module_imports(name):
        top = dep.split(".")[0]
        if top == "sglang":
            assert may_import_sglang, f"{name} imports {dep}: {mine}/ imports no SGLang"
        elif top == "sglang_unicache":
            theirs = folder(dep)
            assert theirs in allowed | {mine, ""}, (
                f"{name} imports {dep}: {mine}/ may import {sorted(allowed) or 'nothing'} "
                "of the package"
            )
        elif top == "torch":
            assert mine != "client", f"{name} imports torch: the client is plain Python"


@pytest.mark.parametrize("name", policy_modules())
def test_policy_imports_point_downwards(name: str) -> None:
    mine = unit(name)
    if not mine:
        pytest.skip("policy/__init__.py is the layer's table of contents: it exports from any rank")
    for dep in module_imports(name):
        if dep.split(".")[0] != "sglang_unicache" or folder(dep) != "policy":
            continue
        theirs = unit(dep)
        if theirs in ("", mine):
            continue
        ok = RANK[theirs] < RANK[mine] or (mine, theirs) in PEER_USES
        assert ok, f"{name} imports {dep}: {theirs} is not below {mine}"


def test_every_module_imports_on_its_own() -> None:
    """Each module imported first, in a fresh package: an import cycle would fail here."""
    names = [n for n in policy_modules() if n != "sglang_unicache.policy.kernels.window_score"]
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
    for cls, prefix in ((ModalityBudget, ""), (SelfCheck, "selfcheck_"), (DynamicRate, ""),
                        (KeepRatio, "")):
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
