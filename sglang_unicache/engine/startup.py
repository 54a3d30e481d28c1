"""Starting the plugin: what ``--unicache`` checks and sets on the server arguments, and the
scheduler's controller, built once the scheduler exists (its pool, its tree, its ranks).

Every refusal is one line (``support.py``, raised as ``flags.UniCacheFlagError``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from sglang_unicache.engine import flags, radix_cache
from sglang_unicache.engine.controller import Controller
from sglang_unicache.engine.kvpool import unwritable_pool
from sglang_unicache.engine.metrics import Metrics
from sglang_unicache.engine.parking import Parking, can_park
from sglang_unicache.engine.scale.tensor_parallel import TensorParallel
from sglang_unicache.engine.support import (
    local_hf_config,
    unsupported_host_quantization,
    unsupported_setup,
)
from sglang_unicache.policy.kernels import warm_up

logger = logging.getLogger("sglang_unicache")

MM_PREPROCESS_CACHE_MB = 256  # --unicache's default for SGLang's image preprocessing cache


def prepare_config(server_args: Any, config: Any) -> Any:
    """Startup checks on the server arguments, and the settings ``--unicache`` implies (its radix
    cache backend, SGLang's image preprocessing cache); the config, unchanged."""
    if config is not None:
        reason = unsupported_setup(server_args, local_hf_config(server_args.model_path)) or \
            unsupported_host_quantization(server_args, config)
        if reason:
            raise flags.UniCacheFlagError(reason)
        backend = server_args.radix_cache_backend
        if backend not in (None, radix_cache.BACKEND):
            raise flags.UniCacheFlagError(
                f"--unicache brings its own radix cache; drop --radix-cache-backend {backend}")
        server_args.radix_cache_backend = radix_cache.BACKEND
        if server_args.mm_preprocess_cache_size_mb is None:
            # A reused image skips the encoder and its prefill; with SGLang's preprocessing cache
            # it skips the image processor too (--mm-preprocess-cache-size-mb 0 turns it off).
            server_args.mm_preprocess_cache_size_mb = MM_PREPROCESS_CACHE_MB
    return config


def scheduler_controller(scheduler: Any) -> Controller | None:
    """The scheduler's controller, after the checks only a built scheduler can make (the
    model's config, the pool's writability); None without ``--unicache``."""
    config = flags.config_of(scheduler.server_args)
    if config is None:
        return None
    hf_config = scheduler.model_config.hf_config.to_dict()
    reason = unsupported_setup(scheduler.server_args, hf_config)
    if reason:
        raise flags.UniCacheFlagError(reason)
    allocator = scheduler.token_to_kv_pool_allocator
    reason = unwritable_pool(allocator.get_kvcache())
    if reason:
        raise flags.UniCacheFlagError(
            f"{reason}: --unicache writes compressed entries into the pool in place (use "
            "--kv-cache-dtype auto, bf16, fp8_e4m3 or fp8_e5m2)")
    tree = scheduler.tree_cache
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    # One writer of /metrics per model replica: the gauges sum over data-parallel ranks.
    exports = scheduler.server_args.enable_metrics and parallel.tp_rank == 0
    controller = Controller(
        config, scheduler.req_to_token_pool.req_to_token, allocator.get_kvcache(), allocator,
        metrics=Metrics() if exports else None,
        tree=tree if isinstance(tree, radix_cache.CompressedRadixCache) else None,
        mrope=bool(scheduler.model_config.model_is_mrope),
        dp_rank=parallel.dp_rank or 0, tp=TensorParallel.of(scheduler),
        on_slots_freed=lambda: _room_made(scheduler))
    if config.overlap_compression:
        if can_park(scheduler):
            controller.parking = Parking()
        else:
            logger.info("sglang-unicache: overlap_compression needs SGLang's overlap scheduler "
                        "without speculative decoding or data-parallel attention; compressing "
                        "prefills are processed before the next batch instead")
    _offsets_from_padding(scheduler)
    _warm_kernels(scheduler)
    logger.info("sglang-unicache: scheduler received config method=%s keep_ratio=%s "
                "min_image_tokens=%s", config.method, config.keep_ratio, config.min_image_tokens)
    return controller


def _offsets_from_padding(scheduler: Any) -> None:
    """LLaVA-NeXT/OneVision (``LlavaBaseForCausalLM`` subclasses in SGLang's llava.py): their
    image processor leaves ``mm_items[i].offsets`` unset, and the model's ``pad_input_ids``
    records where it expanded each ``<image>`` token on the request's inputs instead
    (``image_offsets``, ``image_pad_len``, one per item). Copy them to the items, where the
    plugin (and SGLang's usage counts) read an image's span."""
    pad = getattr(scheduler, "pad_input_ids_func", None)
    if pad is None:
        return

    def pad_input_ids(input_ids, mm_inputs):
        padded = pad(input_ids, mm_inputs)
        item_offsets_from_padding(mm_inputs)
        return padded

    scheduler.pad_input_ids_func = pad_input_ids


def item_offsets_from_padding(mm_inputs: Any) -> None:
    items = getattr(mm_inputs, "mm_items", None) or []
    starts = getattr(mm_inputs, "image_offsets", None) or []
    lengths = getattr(mm_inputs, "image_pad_len", None) or []
    if not items or len(starts) != len(items) or len(lengths) != len(items) or \
            any(item.offsets for item in items):
        return
    for item, start, length in zip(items, starts, lengths, strict=True):
        item.offsets = [(int(start), int(start) + int(length) - 1)]


def _warm_kernels(scheduler: Any) -> None:
    """The Triton kernels compile now, not inside the first request that compresses."""
    pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
    model = scheduler.model_config
    group = model.num_attention_heads // model.num_key_value_heads
    dtype = torch.bfloat16 if pool.dtype.itemsize == 1 else pool.dtype  # as prompt_kv reads it
    warmed = warm_up(pool.device, pool.head_num, pool.head_num * group, pool.head_dim, dtype)
    if warmed:
        logger.info("sglang-unicache: kernels compiled at startup: %s", ", ".join(warmed))


def _room_made(scheduler: Any) -> None:
    """The scheduler marks its running batch full when a waiting request did not fit and
    clears the mark only when a request leaves; slots the plugin frees make room too."""
    scheduler.running_batch.batch_is_full = False
