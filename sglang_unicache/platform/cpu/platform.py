"""The ``SRTPlatform`` subclass behind ``unicache_cpu`` (imported only once SGLang selects it)."""

from __future__ import annotations

import logging
import os

from sglang.srt.platforms.cpu import CpuDeviceMixin
from sglang.srt.platforms.device_mixin import PlatformEnum
from sglang.srt.platforms.interface import PlatformCapabilities, SRTPlatform

from sglang_unicache.platform.cpu import (
    default_max_total_tokens,
    extend_attention,
    hicache,
    malloc,
    threads_bind,
    vision,
)

logger = logging.getLogger(__name__)


class UniCacheCpuPlatform(CpuDeviceMixin, SRTPlatform):
    """Pure-torch CPU platform: torch_native attention, MHA pool, no graphs, no Triton."""

    _enum = PlatformEnum.OOT
    device_name = "cpu"
    device_type = "cpu"
    capabilities = PlatformCapabilities()

    def get_device(self, device_id: int = 0) -> str:  # type: ignore[override]
        # The core builds tensors with device=<this>; "cpu" (a string) is what it expects.
        return "cpu"

    def is_pin_memory_available(self, device=None) -> bool:
        return False

    def get_default_attention_backend(self) -> str:
        return "torch_native"

    def apply_server_args_defaults(self, server_args) -> None:
        if server_args.max_total_tokens is None:
            server_args.max_total_tokens = default_max_total_tokens()
            logger.info(
                "unicache_cpu: capping the KV pool at %d tokens (--max-total-tokens overrides)",
                server_args.max_total_tokens,
            )
        if server_args.attention_backend is None:
            server_args.attention_backend = "torch_native"
        if server_args.sampling_backend is None:
            server_args.sampling_backend = "pytorch"
        # An idle scheduler otherwise spins one core at 100%: on a CPU host that core is the
        # one the next request needs.
        server_args.sleep_on_idle = True
        hicache.server_args_defaults(server_args)
        self._bind_threads(server_args)

    def init_backend(self) -> None:
        malloc.install()
        hicache.install()
        vision.install()
        if extend_attention.install():
            logger.info("unicache_cpu: prefill attention computes the new rows only (%s)",
                        extend_attention.ENV)

    @staticmethod
    def _bind_threads(server_args) -> None:
        """More ranks than NUMA nodes: SGLang needs ``SGLANG_CPU_OMP_THREADS_BIND``; split the
        CPUs this process may use between the ranks unless the user set it."""
        if os.environ.get("SGLANG_CPU_OMP_THREADS_BIND"):
            return
        from sglang.srt.utils.numa_utils import get_cpu_ids_by_node

        ranks = server_args.dp_size * server_args.tp_size * server_args.pp_size
        nodes = len(get_cpu_ids_by_node())
        if ranks <= nodes:
            return
        bind = threads_bind(ranks, sorted(os.sched_getaffinity(0)))
        os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = bind
        logger.info("unicache_cpu: %d ranks on %d NUMA node(s): SGLANG_CPU_OMP_THREADS_BIND=%s",
                    ranks, nodes, bind)
