"""What the plugin expects of the installed SGLang: one pinned version and the hooked targets.

Checked once per process when the plugin registers (DESIGN.md §3). A mismatch stops the process
with one line that names the expected version or the missing target, instead of a traceback deep
inside a half-patched engine.
"""

from __future__ import annotations

import pkgutil
from importlib.metadata import PackageNotFoundError, version

from sglang_unicache import SGLANG_VERSION

_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
# (target, hook function in integration/hooks.py, HookType name) -- registered by plugin.py.
HOOKS = (
    ("sglang.srt.server_args.ServerArgs.add_cli_args", "after_add_cli_args", "AFTER"),
    ("sglang.srt.server_args.ServerArgs.from_cli_args", "around_from_cli_args", "AROUND"),
    (f"{_SCHEDULER}.__init__", "after_scheduler_init", "AFTER"),
    (f"{_SCHEDULER}.run_batch", "around_run_batch", "AROUND"),
    ("sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new",
     "after_forward_batch_init", "AFTER"),
    ("sglang.srt.layers.attention.base_attn_backend.AttentionBackend.forward",
     "around_attention_forward", "AROUND"),
    ("sglang.srt.mem_cache.common.checkpoint_kv_cache", "around_checkpoint_kv_cache", "AROUND"),
    ("sglang.srt.mem_cache.common.release_kv_cache", "around_release_kv_cache", "AROUND"),
    ("sglang.srt.managers.schedule_batch.Req.reset_for_retract", "after_reset_for_retract",
     "AFTER"),
    ("sglang.srt.managers.schedule_batch.Req.init_next_round_input",
     "around_init_next_round_input", "AROUND"),
    ("sglang.srt.models.qwen2_vl.Qwen2VLForConditionalGeneration.get_image_feature",
     "after_get_image_feature", "AFTER"),
    ("sglang.srt.managers.scheduler_components.output_streamer._GenerationStreamAccumulator."
     "accept", "around_stream_accept", "AROUND"),
    ("sglang.srt.managers.scheduler_components.internal_state."
     "SchedulerInternalStateController.get_internal_state", "after_get_internal_state", "AFTER"),
)
# Every dotted target the plugin hooks or patches; each must resolve.
HOOKED_TARGETS = (
    *(target for target, _, _ in HOOKS),
    "sglang.srt.entrypoints.engine.Engine.server_args_class",
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
