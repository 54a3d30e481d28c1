"""What the plugin expects of the installed SGLang: one pinned version and the hooked targets.

Checked once per process when the plugin registers (DESIGN.md §3). A mismatch stops the process
with one line that names the expected version or the missing target, instead of a traceback deep
inside a half-patched engine.
"""

from __future__ import annotations

import pkgutil
from importlib.metadata import PackageNotFoundError, version

from sglang_unicache import SGLANG_VERSION

# Every dotted target the plugin hooks or calls into; each must resolve.
HOOKED_TARGETS = (
    "sglang.srt.server_args.ServerArgs.add_cli_args",
    "sglang.srt.server_args.ServerArgs.from_cli_args",
    "sglang.srt.entrypoints.engine.Engine.server_args_class",
    "sglang.srt.managers.scheduler.Scheduler.__init__",
)


class IncompatibleSGLang(SystemExit):
    """Raised at registration; a SystemExit so SGLang's plugin loader cannot swallow it."""


def installed_sglang_version() -> str | None:
    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def missing_targets(targets: tuple[str, ...] = HOOKED_TARGETS) -> list[str]:
    missing = []
    for target in targets:
        try:
            pkgutil.resolve_name(target)
        except (ImportError, AttributeError, ValueError):
            missing.append(target)
    return missing


def check_compatible(targets: tuple[str, ...] = HOOKED_TARGETS) -> None:
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
