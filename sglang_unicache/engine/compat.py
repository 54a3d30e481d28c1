"""What the plugin expects of the installed SGLang: one pinned version and the hooked targets.

Checked once per process when the plugin registers: the version before anything of SGLang is
imported, then the targets the hooks declare (``hooks.targets()``). A mismatch stops the process
with one line that names the expected version or the missing target, instead of a traceback deep
inside a half-patched engine.
"""

from __future__ import annotations

import pkgutil
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version

from sglang_unicache import SGLANG_VERSION


class IncompatibleSGLang(SystemExit):
    """Raised at registration; a SystemExit so SGLang's plugin loader cannot swallow it."""


def installed_sglang_version() -> str | None:
    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def missing_targets(targets: Sequence[str]) -> list[str]:
    missing = []
    for target in targets:
        try:
            pkgutil.resolve_name(target)
        except (ImportError, AttributeError, ValueError):
            missing.append(target)
    return missing


def check_compatible(targets: Sequence[str] = ()) -> None:
    """Stop with one line unless SGLang is exactly the pinned version and every target exists."""
    found = installed_sglang_version()
    if found != SGLANG_VERSION:
        raise IncompatibleSGLang(
            f"sglang-unicache: expected sglang=={SGLANG_VERSION}, found {found or 'none'}; "
            f"install the pinned version (pip install sglang=={SGLANG_VERSION})"
        )
    missing = missing_targets(targets)
    if missing:
        raise IncompatibleSGLang(
            f"sglang-unicache: sglang=={SGLANG_VERSION} lacks the hooked target {missing[0]}"
        )
