"""The hook functions the plugin installs on SGLang (see ``plugin.register`` for the targets)."""

from __future__ import annotations

import logging
import time
from typing import Any

from sglang_unicache.integration import capture, flags, positions, radix_cache
from sglang_unicache.integration.controller import Controller
from sglang_unicache.integration.integrity import check_integrity
from sglang_unicache.integration.metrics import Metrics
from sglang_unicache.integration.support import local_hf_config, unsupported_setup

logger = logging.getLogger("sglang_unicache")


class UniCacheStartupError(SystemExit):
    """One-line startup failure; a SystemExit so the launcher prints it without a traceback."""

    def __init__(self, message: str) -> None:
        super().__init__(f"error: {message}")


def _prepare_config(server_args: Any, config: Any) -> Any:
    if config is not None:
        reason = unsupported_setup(server_args, local_hf_config(server_args.model_path))
        if reason:
            raise flags.UniCacheFlagError(reason)
        backend = server_args.radix_cache_backend
        if backend not in (None, radix_cache.BACKEND):
            raise flags.UniCacheFlagError(
                f"--unicache brings its own radix cache; drop --radix-cache-backend {backend}")
        server_args.radix_cache_backend = radix_cache.BACKEND
        if not server_args.disable_overlap_schedule:
            # Compaction rewrites a request's lengths between its prefill and its first decode;
            # the overlap scheduler would already have launched that decode.
            server_args.disable_overlap_schedule = True
            logger.info("sglang-unicache: --unicache runs with the overlap scheduler disabled")
    return config


def after_add_cli_args(result: Any, parser: Any) -> Any:
    flags.add_cli_args(parser)
    return result


def around_from_cli_args(original: Any, cls: Any, args: Any) -> Any:
    server_args = original(cls, args)
    try:
        config = _prepare_config(server_args, flags.config_from_namespace(args))
    except flags.UniCacheFlagError as exc:
        raise UniCacheStartupError(str(exc)) from None
    flags.attach(server_args, config)
    if config is not None:
        logger.info("sglang-unicache: enabled (method=%s, keep_ratio=%s)",
                    config.method, config.keep_ratio)
    return server_args


def make_engine_server_args(**kwargs: Any) -> Any:
    """``Engine.server_args_class``: ServerArgs plus the ``unicache*`` keyword arguments."""
    from sglang.srt.server_args import ServerArgs

    config = flags.pop_engine_kwargs(kwargs)
    server_args = ServerArgs(**kwargs)
    flags.attach(server_args, _prepare_config(server_args, config))
    return server_args


_controller: Controller | None = None
_scheduler: Any = None


def after_scheduler_init(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    global _controller, _scheduler
    config = flags.config_of(scheduler.server_args)
    if config is None:
        return result
    hf_config = scheduler.model_config.hf_config.to_dict()
    reason = unsupported_setup(scheduler.server_args, hf_config)
    if reason:
        raise flags.UniCacheFlagError(reason)
    if getattr(scheduler, "enable_overlap", False):
        # Only reachable with a hand-built ServerArgs; the flag paths turn overlap off.
        raise flags.UniCacheFlagError("--unicache needs --disable-overlap-schedule")
    allocator = scheduler.token_to_kv_pool_allocator
    _controller = Controller(config, scheduler.req_to_token_pool.req_to_token,
                             allocator.get_kvcache(), allocator)
    if scheduler.server_args.enable_metrics:
        _controller.metrics = Metrics()
    scheduler.unicache = _controller
    _controller.mrope = bool(scheduler.model_config.model_is_mrope)
    _scheduler = scheduler
    if isinstance(scheduler.tree_cache, radix_cache.CompressedRadixCache):
        scheduler.tree_cache.controller = _controller
        _controller.tree = scheduler.tree_cache
    logger.info("sglang-unicache: scheduler received config method=%s keep_ratio=%s "
                "min_image_tokens=%s", config.method, config.keep_ratio, config.min_image_tokens)
    return result


def _compress(req: Any) -> None:
    freed = _controller.stats.slots_freed
    _controller.on_checkpoint(req)
    if _controller.stats.slots_freed > freed and _scheduler is not None:
        # The scheduler marks its running batch full when a waiting request did not fit and
        # clears the mark only when a request leaves; slots freed by compaction count too.
        _scheduler.running_batch.batch_is_full = False
    _publish()


def _publish() -> None:
    if _controller is not None and _controller.metrics is not None:
        _controller.metrics.sync(_controller.stats, _controller.gauges())


def around_run_batch(original: Any, scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    if _controller is None or not batch.forward_mode.is_extend():
        return original(scheduler, batch, *args, **kwargs)
    active = _controller.begin_forward(batch)
    capture.set_active(active)
    start = time.perf_counter()
    try:
        return original(scheduler, batch, *args, **kwargs)
    finally:
        capture.set_active(None)
        if active is not None:
            _controller.stats.prefill_seconds += time.perf_counter() - start


def around_checkpoint_kv_cache(original: Any, req: Any, tree_cache: Any, *args: Any,
                               **kwargs: Any) -> Any:
    if _controller is not None:
        if _controller.defer_chunk_checkpoint(req):
            # What checkpoint_kv_cache does besides the tree insert: the next chunk resumes here.
            req.prefix_len = req.extend_end
            return None
        _compress(req)
    return original(req, tree_cache, *args, **kwargs)


def around_init_next_round_input(original: Any, req: Any, tree_cache: Any = None,
                                 *args: Any, **kwargs: Any) -> Any:
    if _controller is None or tree_cache is None:
        return original(req, tree_cache, *args, **kwargs)
    _controller.match_with_reuse(lambda: original(req, tree_cache, *args, **kwargs), req)
    _publish()
    return None


def after_get_image_feature(result: Any, *args: Any, **kwargs: Any) -> Any:
    if _controller is not None:
        _controller.stats.vision_encoder_calls += 1
    return result


def around_release_kv_cache(original: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """A request that finished with its prefill (e.g. max_tokens=1) is compressed before its KV
    enters the tree, like one that goes on decoding."""
    if _controller is None:
        return original(req, *args, **kwargs)
    _compress(req)
    return original(req, *args, **kwargs)


def after_reset_for_retract(result: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    if _controller is not None:
        _controller.on_retract(req)
    return result


def around_stream_accept(original: Any, accumulator: Any, *args: Any, req: Any,
                         **kwargs: Any) -> Any:
    """Usage reports the prompt as the user sent it, not the compacted row: prompt tokens with
    the entries compression removed, cached tokens with those of the compressed spans reused."""
    before = len(accumulator.prompt_tokens)
    result = original(accumulator, *args, req=req, **kwargs)
    if len(accumulator.prompt_tokens) > before:
        accumulator.prompt_tokens[-1] += getattr(req, "unicache_removed", 0)
        accumulator.cached_tokens[-1] += getattr(req, "unicache_reused", 0)
    return result


def after_get_internal_state(result: Any, state_controller: Any, *args: Any, **kwargs: Any) -> Any:
    """``/server_info`` shows the allocator's free slots (also without --unicache) and our stats."""
    allocator = state_controller.scheduler.token_to_kv_pool_allocator
    result.internal_state["kv_available_slots"] = int(allocator.available_size())
    if _controller is not None:
        result.internal_state["unicache"] = {
            **_controller.snapshot(),
            "integrity": check_integrity(state_controller.scheduler, _controller)}
    return result


def after_forward_batch_init(result: Any, *args: Any, **kwargs: Any) -> Any:
    """``ForwardBatch.init_new``: 1-D RoPE models get each request's position offset."""
    if _controller is not None and _controller.active and not _controller.mrope:
        batch = kwargs.get("batch") or next(a for a in args if hasattr(a, "reqs"))
        positions.shift_positions(result, batch.reqs)
    return result


around_attention_forward = capture.around_attention_forward
