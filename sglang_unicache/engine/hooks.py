"""The hook functions the plugin installs on SGLang, each declaring its own target.

``@hook(target, kind)`` records (target, function, ``HookType`` name) in ``HOOKS``;
``plugin.register`` checks that every target resolves and registers them all. The process's state
(the scheduler's controller, the capture of the forward in flight, the overlap drain) lives in one
object, ``STATE``, set by the scheduler hook: in every other process it stays empty and every hook
passes through.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from sglang_unicache.engine import flags, positions, request, startup
from sglang_unicache.engine.capture import QueryCapture
from sglang_unicache.engine.controller import Controller
from sglang_unicache.engine.integrity import check_integrity
from sglang_unicache.engine.overlap import OverlapDrain
from sglang_unicache.engine.scale import routing
from sglang_unicache.platform.cpu import dp_idle

logger = logging.getLogger("sglang_unicache")


_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
_SCHEDULE_BATCH = "sglang.srt.managers.schedule_batch"
_MEM_CACHE = "sglang.srt.mem_cache.common"
_RESULTS = "sglang.srt.managers.scheduler_components.batch_result_processor." \
    "SchedulerBatchResultProcessor"

HOOKS: list[tuple[str, Callable, str]] = []


def hook(target: str, kind: str) -> Callable[[Callable], Callable]:
    """Declare ``fn`` as the ``kind`` (AFTER, AROUND) hook of SGLang's dotted ``target``."""

    def declare(fn: Callable) -> Callable:
        HOOKS.append((target, fn, kind))
        return fn

    return declare


def targets() -> tuple[str, ...]:
    """Every dotted target the plugin hooks or patches; each must resolve (``compat.py``)."""
    return (*(target for target, _, _ in HOOKS), dp_idle.TARGET,
            "sglang.srt.entrypoints.engine.Engine.server_args_class")


@dataclass
class PluginState:
    """What the plugin holds in this process. Only a scheduler process with ``--unicache`` has a
    controller; ``capture`` is set only while an extend batch with targets runs."""

    controller: Controller | None = None
    capture: QueryCapture | None = None
    overlap: OverlapDrain = field(default_factory=OverlapDrain)  # the overlap scheduler's order
    # While a prefill's result is processed: the checkpoints that compress, run once its first
    # tokens are streamed (``around_process_batch_result_prefill``); None otherwise.
    after_stream: list[Callable[[], None]] | None = None


STATE = PluginState()


class UniCacheStartupError(SystemExit):
    """One-line startup failure; a SystemExit so the launcher prints it without a traceback."""

    def __init__(self, message: str) -> None:
        super().__init__(f"error: {message}")


CHECK_INTEGRITY = "SGLANG_UNICACHE_CHECK_INTEGRITY"  # "1": /server_info runs check_integrity


@hook("sglang.srt.server_args.ServerArgs.add_cli_args", "AFTER")
def after_add_cli_args(result: Any, parser: Any) -> Any:
    flags.add_cli_args(parser)
    return result


@hook("sglang.srt.server_args.ServerArgs.from_cli_args", "AROUND")
def around_from_cli_args(original: Any, cls: Any, args: Any) -> Any:
    server_args = original(cls, args)
    try:
        config = startup.prepare_config(server_args, flags.config_from_namespace(args))
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
    flags.attach(server_args, startup.prepare_config(server_args, config))
    return server_args


@hook(f"{_SCHEDULER}.__init__", "AFTER")
def after_scheduler_init(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    controller = startup.scheduler_controller(scheduler)
    if controller is not None:
        STATE.controller = controller
    return result


def _compress(req: Any) -> None:
    STATE.controller.on_checkpoint(req)
    STATE.controller.publish()


@hook(f"{_SCHEDULER}.run_batch", "AROUND")
def around_run_batch(original: Any, scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    controller = STATE.controller
    if controller is None or not batch.forward_mode.is_extend():
        return original(scheduler, batch, *args, **kwargs)
    STATE.capture = controller.begin_forward(batch)
    timed = controller.prefills_for_compression()
    start = time.perf_counter()
    try:
        result = original(scheduler, batch, *args, **kwargs)
        if STATE.capture is not None:
            controller.park_targets(batch)  # with overlap_compression
            STATE.overlap.compresses(result)
        return result
    finally:
        if timed:
            _forward_done()
            controller.stats.prefill_seconds += time.perf_counter() - start
            controller.stats.prefill_tokens += sum(batch.extend_lens)
        STATE.capture = None


def _forward_done() -> None:
    """Wait for the forward a timed prefill queued: on CUDA the overlap scheduler's ``run_batch``
    returns once the forward is launched, so its clock would read the launch, and the compression
    after it (whose copies to the host wait for the device) would carry the rest of the prefill.
    The step after a compressing prefill waits for its result anyway (``overlap.py``); a middle
    chunk of a long compressing prompt loses its overlap. Nothing to wait for on a CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


@hook(f"{_SCHEDULER}.get_next_batch_to_run", "AROUND")
def around_get_next_batch_to_run(original: Any, scheduler: Any, running_batch: Any = None,
                                 last_batch: Any = None) -> Any:
    """Overlap scheduler: compressing prefills' results are processed before the next batch is
    built (``overlap.py``); with ``overlap_compression`` their targets sit out this build, and
    are compressed and come back at the next (``parking.py``)."""
    controller = STATE.controller
    if controller is not None:
        STATE.overlap.drain(scheduler)
        if controller.parking is not None:
            controller.parking.run_deferred()
            controller.publish()
            running_batch = controller.parking.rejoin(scheduler, running_batch)
            controller.parking.exclude(last_batch, running_batch)
    return original(scheduler, running_batch=running_batch, last_batch=last_batch)


@hook(f"{_SCHEDULER}.collect_inflight_reqs", "AROUND")
def around_collect_inflight_reqs(original: Any, scheduler: Any) -> Any:
    """The requests sitting out a step (``parking.py``) are in flight though in no batch: an
    abort sent then marks them as it marks a running request, and they leave at their first
    step back."""
    reqs = original(scheduler)
    controller = STATE.controller
    if controller is not None and controller.parking is not None:
        reqs = {*reqs, *controller.parking.parked.values()}
    return reqs


@hook(f"{_SCHEDULER}.process_batch_result", "AROUND")
def around_process_batch_result(original: Any, scheduler: Any, batch: Any, result: Any,
                                *args: Any, **kwargs: Any) -> Any:
    if STATE.overlap.already_processed(result):
        return None
    return original(scheduler, batch, result, *args, **kwargs)


@hook("sglang.srt.layers.attention.base_attn_backend.AttentionBackend.forward", "AROUND")
def around_attention_forward(original, backend, q, k, v, layer, forward_batch, *args, **kwargs):
    """Every layer's post-RoPE queries of the extend tokens, for any attention backend
    (``capture.py``)."""
    if STATE.capture is not None and forward_batch.forward_mode.is_extend():
        STATE.capture.record(layer.layer_id, q, layer.head_dim)
    return original(backend, q, k, v, layer, forward_batch, *args, **kwargs)


@hook(f"{_RESULTS}.process_batch_result_prefill", "AROUND")
def around_process_batch_result_prefill(original: Any, processor: Any, batch: Any,
                                        *args: Any, **kwargs: Any) -> Any:
    """A prefill's first tokens reach their clients before its requests are compressed: the
    checkpoints that compress wait until SGLang has streamed the batch's outputs (the end of
    this call, still before the next batch is built), so compression is not in the time to
    first token. Nothing between the checkpoint and the stream reads what compression changes
    (usage counts the prompt as sent either way, ``around_stream_accept``)."""
    if STATE.controller is None:
        return original(processor, batch, *args, **kwargs)
    STATE.after_stream = []
    try:
        return original(processor, batch, *args, **kwargs)
    finally:
        waiting, STATE.after_stream = STATE.after_stream, None
        for checkpoint in waiting:
            checkpoint()


@hook(f"{_MEM_CACHE}.checkpoint_kv_cache", "AROUND")
def around_checkpoint_kv_cache(original: Any, req: Any, tree_cache: Any, *args: Any,
                               **kwargs: Any) -> Any:
    controller = STATE.controller
    if controller is not None:
        if controller.defer_chunk_checkpoint(req):
            # What checkpoint_kv_cache does besides the tree insert: the next chunk resumes here.
            req.prefix_len = req.extend_end
            return None
        if STATE.after_stream is not None and controller.compresses(req):
            def compress() -> None:
                _compress(req)
                original(req, tree_cache, *args, **kwargs)

            if controller.parks(req):
                controller.parking.defer(req, compress)
            else:
                STATE.after_stream.append(compress)
            return None
        _compress(req)
    return original(req, tree_cache, *args, **kwargs)


@hook(f"{_MEM_CACHE}.release_kv_cache", "AROUND")
def around_release_kv_cache(original: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """A request that finished with its prefill (e.g. max_tokens=1) is compressed before its KV
    enters the tree, like one that goes on decoding."""
    if STATE.controller is not None:
        _compress(req)
    return original(req, *args, **kwargs)


@hook(f"{_SCHEDULE_BATCH}.Req.init_next_round_input", "AROUND")
def around_init_next_round_input(original: Any, req: Any, tree_cache: Any = None,
                                 *args: Any, **kwargs: Any) -> Any:
    if STATE.controller is None or tree_cache is None:
        return original(req, tree_cache, *args, **kwargs)
    STATE.controller.match_with_reuse(lambda: original(req, tree_cache, *args, **kwargs), req)
    STATE.controller.publish()
    return None


@hook(f"{_SCHEDULE_BATCH}.Req.reset_for_retract", "AFTER")
def after_reset_for_retract(result: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    if STATE.controller is not None:
        STATE.controller.on_retract(req)
    return result


@hook("sglang.srt.managers.scheduler_components.output_streamer._GenerationStreamAccumulator."
      "accept", "AROUND")
def around_stream_accept(original: Any, accumulator: Any, *args: Any, req: Any,
                         **kwargs: Any) -> Any:
    """Usage reports the prompt as the user sent it, not the compacted row: prompt tokens with
    the entries compression removed, cached tokens with those of the compressed spans reused."""
    before = len(accumulator.prompt_tokens)
    result = original(accumulator, *args, req=req, **kwargs)
    if len(accumulator.prompt_tokens) > before:
        state = request.existing_state(req)
        if state is not None:
            accumulator.prompt_tokens[-1] += state.removed
            accumulator.cached_tokens[-1] += state.reused
    return result


@hook("sglang.srt.managers.scheduler_components.internal_state."
      "SchedulerInternalStateController.get_internal_state", "AFTER")
def after_get_internal_state(result: Any, state_controller: Any, *args: Any, **kwargs: Any) -> Any:
    """``/server_info`` shows the allocator's free slots (also without --unicache) and our stats;
    with ``SGLANG_UNICACHE_CHECK_INTEGRITY=1`` also ``check_integrity``'s findings (it reads the
    whole pool on the scheduler thread, so it is off unless asked for: tests and benchmarks)."""
    allocator = state_controller.scheduler.token_to_kv_pool_allocator
    result.internal_state["kv_available_slots"] = int(allocator.available_size())
    if STATE.controller is not None:
        state = STATE.controller.snapshot()
        if os.environ.get(CHECK_INTEGRITY) == "1":
            state["integrity"] = check_integrity(state_controller.scheduler) \
                + STATE.controller.integrity_errors()
        result.internal_state["unicache"] = state
    return result


@hook("sglang.srt.managers.tokenizer_control_mixin.TokenizerControlMixin.get_internal_state",
      "AROUND")
async def around_tokenizer_internal_state(original: Any, manager: Any) -> Any:
    """``/server_info``: each entry also shows SGLang's image preprocessing cache (it lives in
    the tokenizer manager): whether it is on, its hits and misses."""
    states = await original(manager)
    cache = getattr(getattr(manager, "mm_processor", None), "mm_preprocess_cache", None)
    if cache is not None:
        info = {"enabled": cache.enabled, "hits": cache.hits, "misses": cache.misses,
                "entries": len(cache)}
        for state in states:
            state["mm_preprocess_cache"] = info
    return states


@hook("sglang.srt.managers.data_parallel_controller.DataParallelController."
      "maybe_external_dp_rank_routing", "AROUND")
def around_dp_routing(original: Any, dp_controller: Any, req: Any) -> Any:
    """With ``--unicache --dp-size N``: a request with an image goes to the replica holding that
    image (``routing.py``); SGLang then routes it as if the client had named the rank."""
    config = flags.config_of(dp_controller.server_args)
    if config is None or not config.dp_routing:
        return original(dp_controller, req)
    affinity = getattr(dp_controller, "unicache_affinity", None)
    if affinity is None:
        affinity = dp_controller.unicache_affinity = routing.ImageAffinity(
            len(dp_controller.workers))
    key = routing.image_key(req) if req.routed_dp_rank is None else None
    if key is not None:
        req.routed_dp_rank = affinity.pick(key, list(dp_controller._active_workers))
    return original(dp_controller, req)


@hook("sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new", "AFTER")
def after_forward_batch_init(result: Any, *args: Any, **kwargs: Any) -> Any:
    """``ForwardBatch.init_new``: 1-D RoPE models get each request's position offset."""
    controller = STATE.controller
    if controller is not None and controller.active and not controller.mrope:
        batch = kwargs.get("batch") or next(a for a in args if hasattr(a, "reqs"))
        positions.shift_positions(result, batch.reqs)
    return result
