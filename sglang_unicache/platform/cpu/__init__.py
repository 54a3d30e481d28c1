"""``unicache_cpu``: an out-of-tree SGLang platform that runs the real engine on a CPU.

SGLang's own CPU engine (``SGLANG_USE_CPU_ENGINE=1``) needs a CPU build of sgl-kernel that is not on
the package registry. An out-of-tree platform (``PlatformEnum.OOT``, ``device_type = "cpu"``)
instead makes the core take its pure-torch paths: no sgl_kernel, no vllm ops, the ``torch_native``
attention backend and the ordinary ``MHATokenToKVPool``. The scheduler, the radix cache and the
model code are SGLang's own.

Activation (``activate`` is the ``sglang.srt.platforms`` entry point):

- ``SGLANG_PLATFORM=unicache_cpu`` selects it explicitly, even on a machine with a GPU;
- with ``SGLANG_PLATFORM`` unset it activates only when torch sees no accelerator;
- never together with ``SGLANG_USE_CPU_ENGINE=1`` (SGLang's own CPU engine).

On a CPU the default KV pool would take most of the RAM, so the platform caps
``max_total_tokens`` (``SGLANG_UNICACHE_CPU_MAX_TOTAL_TOKENS``, default 32768) unless the user
passes ``--max-total-tokens``, and turns on ``sleep_on_idle`` (an idle scheduler would otherwise
spin a core at 100%; so would the data-parallel controller, which the plugin's
``dp_idle.py`` makes block on its socket when that flag is on).

Each worker's vision tower attends one image at a time (``vision.py``: SGLang's CPU path
masks a whole prefill batch as one sequence), HiCache gets its CPU pieces (``hicache.py``),
glibc keeps freed memory for the next tensor instead of page-faulting it in again
(``malloc.py``), and a prefill after a cached prefix attends over its new rows only
(``extend_attention.py``; ``UNICACHE_CPU_EXTEND_ROWS=0`` keeps SGLang's whole-sequence extend).

With more ranks (``dp x tp x pp``) than NUMA nodes and no ``SGLANG_CPU_OMP_THREADS_BIND``,
SGLang refuses to start; the platform then sets that variable, splitting this process's CPUs
evenly between the ranks (``threads_bind``).
"""

from __future__ import annotations

import os

import torch

PLATFORM_NAME = "unicache_cpu"
PLATFORM_CLASS = "sglang_unicache.platform.cpu.platform.UniCacheCpuPlatform"
DEFAULT_MAX_TOTAL_TOKENS = 32768


def _accelerator_visible() -> bool:
    if torch.cuda.is_available():
        return True
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return True
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def activate() -> str | None:
    """Entry point of ``sglang.srt.platforms``: the platform class's qualified name, or None."""
    if os.environ.get("SGLANG_USE_CPU_ENGINE", "0") == "1":
        if os.environ.get("SGLANG_PLATFORM") == PLATFORM_NAME:
            raise RuntimeError(
                "SGLANG_PLATFORM=unicache_cpu cannot be combined with SGLANG_USE_CPU_ENGINE=1; "
                "unset one of them"
            )
        return None
    selected = os.environ.get("SGLANG_PLATFORM")
    if selected == PLATFORM_NAME:
        return PLATFORM_CLASS
    if selected or _accelerator_visible():
        return None
    return PLATFORM_CLASS


def default_max_total_tokens() -> int:
    raw = os.environ.get("SGLANG_UNICACHE_CPU_MAX_TOTAL_TOKENS", str(DEFAULT_MAX_TOTAL_TOKENS))
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value <= 0:
        raise ValueError(
            f"SGLANG_UNICACHE_CPU_MAX_TOTAL_TOKENS must be a positive integer, got {raw!r}"
        )
    return value


def threads_bind(ranks: int, cpus: list[int]) -> str:
    """``SGLANG_CPU_OMP_THREADS_BIND`` giving each of ``ranks`` ranks a contiguous, equal share of
    ``cpus`` (one CPU each, shared round robin, when there are fewer CPUs than ranks)."""
    cpus = sorted(cpus)
    if len(cpus) < ranks:
        return "|".join(str(cpus[i % len(cpus)]) for i in range(ranks))
    share = len(cpus) // ranks
    groups = [cpus[i * share:(i + 1) * share] for i in range(ranks)]
    return "|".join(",".join(map(str, group)) for group in groups)


def is_current() -> bool:
    """Whether SGLang runs on this platform in this process."""
    from sglang.srt.platforms import current_platform

    return getattr(current_platform, "device_name", None) == "cpu" and \
        type(current_platform).__module__.startswith("sglang_unicache.platform")
