"""When the ``unicache_cpu`` platform activates, and the pool cap it applies."""

from __future__ import annotations

import pytest

from sglang_unicache.platform import cpu

CLASS = "sglang_unicache.platform.cpu.platform.UniCacheCpuPlatform"


@pytest.fixture
def env(monkeypatch):
    names = ("SGLANG_PLATFORM", "SGLANG_USE_CPU_ENGINE", "SGLANG_UNICACHE_CPU_MAX_TOTAL_TOKENS")
    for name in names:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_auto_activates_without_accelerator(env):
    env.setattr(cpu, "_accelerator_visible", lambda: False)
    assert cpu.activate() == CLASS


def test_never_active_on_a_gpu_unless_asked(env):
    env.setattr(cpu, "_accelerator_visible", lambda: True)
    assert cpu.activate() is None
    env.setenv("SGLANG_PLATFORM", "unicache_cpu")
    assert cpu.activate() == CLASS


def test_other_platform_selected(env):
    env.setattr(cpu, "_accelerator_visible", lambda: False)
    env.setenv("SGLANG_PLATFORM", "someone_else")
    assert cpu.activate() is None


def test_not_with_sglang_cpu_engine(env):
    env.setattr(cpu, "_accelerator_visible", lambda: False)
    env.setenv("SGLANG_USE_CPU_ENGINE", "1")
    assert cpu.activate() is None
    env.setenv("SGLANG_PLATFORM", "unicache_cpu")
    with pytest.raises(RuntimeError, match="cannot be combined with SGLANG_USE_CPU_ENGINE"):
        cpu.activate()


def test_platform_class_resolves_and_defaults(env):
    import pkgutil

    pytest.importorskip("sglang")  # the whole package first (its platform import is circular)
    platform = pkgutil.resolve_name(CLASS)()
    assert platform.is_out_of_tree()
    assert platform.get_device() == "cpu"
    assert platform.get_default_attention_backend() == "torch_native"


def test_pool_cap_env(env):
    assert cpu.default_max_total_tokens() == cpu.DEFAULT_MAX_TOTAL_TOKENS
    env.setenv("SGLANG_UNICACHE_CPU_MAX_TOTAL_TOKENS", "4096")
    assert cpu.default_max_total_tokens() == 4096
    env.setenv("SGLANG_UNICACHE_CPU_MAX_TOTAL_TOKENS", "lots")
    with pytest.raises(ValueError, match="SGLANG_UNICACHE_CPU_MAX_TOTAL_TOKENS"):
        cpu.default_max_total_tokens()


def test_threads_bind_splits_the_cpus_between_ranks():
    assert cpu.threads_bind(2, [0, 1]) == "0|1"
    assert cpu.threads_bind(2, [4, 5, 6, 7, 0, 1, 2, 3]) == "0,1,2,3|4,5,6,7"
    assert cpu.threads_bind(3, [0, 1, 2, 3, 4, 5, 6]) == "0,1|2,3|4,5"
    assert cpu.threads_bind(4, [0, 1]) == "0|1|0|1"  # fewer CPUs than ranks: shared


def test_more_ranks_than_numa_nodes_get_a_binding(env):
    """SGLang at DP = 2 on a one-node CPU host stops at startup without a thread binding
    ("SGLANG_CPU_OMP_THREADS_BIND is not set ..."); the platform sets it unless the user did."""
    import pkgutil
    from types import SimpleNamespace

    pytest.importorskip("sglang")  # the whole package first (its platform import is circular)
    from sglang.srt.utils.numa_utils import get_cpu_ids_by_node

    env.delenv("SGLANG_CPU_OMP_THREADS_BIND", raising=False)
    platform = pkgutil.resolve_name(CLASS)()
    ranks = len(get_cpu_ids_by_node()) + 1
    args = SimpleNamespace(dp_size=ranks, tp_size=1, pp_size=1)
    platform._bind_threads(args)
    import os

    bind = os.environ["SGLANG_CPU_OMP_THREADS_BIND"]
    assert len(bind.split("|")) == ranks
    env.setenv("SGLANG_CPU_OMP_THREADS_BIND", "0|0|0")
    platform._bind_threads(args)
    assert os.environ["SGLANG_CPU_OMP_THREADS_BIND"] == "0|0|0"  # the user's setting wins
