"""Compression beside the overlap loop (``overlap_compression``): a compressing request sits out
one batch instead of that batch waiting for its compression.

Without it, ``overlap.py`` processes a compressing prefill's result before the next batch is
built and compresses its targets right after their first tokens are streamed, so the request
joins the decode batch at its compacted length, and that batch waits for the compression: the
requests already decoding meet the prefill and the compression in one gap between two of their
tokens. With it, the prefill's targets are parked as it runs (``park``). The result is still
processed before the next build, so their first tokens leave as early, but their compression
(and their checkpoint into the tree) waits (``defer``); at that build they are kept out of the
batch SGLang merges into the running batch (``exclude``), the next batch runs without them, and
at the build after it they are compressed (``run_deferred``) and come back as one decode batch at
the length compaction left (``rejoin``). The requests already decoding meet the prefill and the
compression in two gaps; a parked request's second token comes one step later.

A parked request is in no SGLang batch for one step: its slots are its own (not in the tree until
its checkpoint), its first token waits in SGLang's relay buffer under its row, as every request's
does between two steps (``rejoin`` stashes it again, as SGLang's own staged decode does), and it
counts among SGLang's in-flight requests (``hooks.around_collect_inflight_reqs``), so an abort
sent then marks it to finish and it leaves at its first step back. Only
where that holds: the overlap loop, no speculative decoding and no data-parallel attention (their
batches carry more state); requests with penalties, a grammar or a custom logit processor are
compressed at once as without this (their sampling state is built from the batch they ran in).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


def can_park(scheduler) -> bool:
    """Whether this scheduler's loop lets a request sit out a step (see the module doc)."""
    return (bool(getattr(scheduler, "enable_overlap", False))
            and scheduler.spec_algorithm.is_none()
            and not getattr(scheduler, "require_mlp_sync", False))


def parkable(req) -> bool:
    """A request whose sampling state does not depend on the batch it decodes in."""
    params = req.sampling_params
    return (params.frequency_penalty == 0 and params.presence_penalty == 0
            and params.repetition_penalty == 1 and params.min_new_tokens == 0
            and not params.logit_bias and req.grammar is None
            and getattr(req, "custom_logit_processor", None) is None
            and not req.return_logprob and not req.return_hidden_states)


@dataclass
class Parking:
    # Requests out of every batch, by rid: parked as their prefill ran (``fresh``: not yet kept
    # out of a build), until they are compressed and rejoin.
    parked: dict[str, object] = field(default_factory=dict)
    fresh: list = field(default_factory=list)
    # Their compression targets (``targets.Targets.take``'s), held here: their compression runs
    # after the next batch, and a next extend batch starts a new set of targets.
    held: dict[str, tuple] = field(default_factory=dict)
    # Their compressions (and checkpoints), by rid: deferred when their result is processed, run
    # at the build after the one they sat out.
    deferred: dict[str, Callable[[], None]] = field(default_factory=dict)
    parked_total: int = 0  # requests that sat out a step (``/server_info``: requests_parked)

    def park(self, reqs: list, take) -> bool:
        """The compression targets of the prefill now running sit out the next build, each with
        ``take(req)``, its targets; False (nothing parked, nothing taken) if any of them
        cannot."""
        if not reqs or not all(parkable(req) for req in reqs):
            return False
        for req in reqs:
            self.parked[req.rid] = req
            self.held[req.rid] = take(req)
        self.fresh.extend(reqs)
        self.parked_total += len(reqs)
        return True

    def holds(self, req) -> bool:
        """Whether ``req``'s compression targets wait here (its checkpoint compresses)."""
        return req.rid in self.held

    def take(self, req) -> tuple | None:
        """The parked request's compression targets, once (its checkpoint)."""
        return self.held.pop(req.rid, None)

    def defer(self, req, compress: Callable[[], None]) -> None:
        """Its result processed: the parked request's compression and checkpoint wait."""
        self.deferred[req.rid] = compress

    def run_deferred(self) -> None:
        """Before a build: the deferred compressions of the requests that sat out a batch."""
        ready = [rid for rid in self.deferred
                 if not _in_fresh(self.parked.get(rid), self.fresh)]
        for rid in ready:
            self.deferred.pop(rid)()

    def exclude(self, last_batch, running_batch) -> None:
        """Before the build that follows their prefill: the fresh parked requests leave the
        prefill batch SGLang is about to merge into ``running_batch``."""
        if not self.fresh:
            return
        leaving, self.fresh = self.fresh, []
        if last_batch is not None and last_batch.forward_mode.is_extend():
            size = last_batch.batch_size()
            last_batch.filter_batch(reqs_to_exclude=leaving)
            if last_batch.batch_size() < size and running_batch is not None:
                running_batch.batch_is_full = False  # as SGLang does when it filters

    def rejoin(self, scheduler, running_batch):
        """Before a build: the parked requests whose prefill result was processed (their first
        token is in ``output_ids``) and who were compressed (their targets taken, nothing
        deferred) go back into the running batch, those their prefill finished are dropped.
        Returns the running batch to build from."""
        done = [req for req in self.parked.values()
                if req.output_ids and not _in_fresh(req, self.fresh)
                and req.rid not in self.held and req.rid not in self.deferred]
        if not done:
            return running_batch
        for req in done:
            del self.parked[req.rid]
        back = [req for req in done if not req.finished()]
        if not back:
            return running_batch
        batch = decode_batch(scheduler, back)
        if running_batch is None or running_batch.is_empty():
            return batch
        running_batch.merge_batch(batch)
        return running_batch

    def check(self) -> list[str]:
        """``check_integrity`` lines: a request its prefill finished that is still parked, and
        targets or a compression left behind by a request no longer parked."""
        stuck = [rid for rid, req in self.parked.items() if req.output_ids and req.finished()]
        lines = [f"parked request {rid} finished but still parked" for rid in stuck]
        lost = [rid for rid in {*self.held, *self.deferred} if rid not in self.parked]
        return lines + [f"parked request {rid} left without its compression" for rid in lost]


def _in_fresh(req, fresh: list) -> bool:
    return req is not None and any(r is req for r in fresh)


def decode_batch(scheduler, reqs: list):
    """A decode batch of ``reqs``, each at its committed length with its last token in SGLang's
    relay buffer (the construction of SGLang's ``_build_hisparse_decode_batch``)."""
    from sglang.srt.managers.overlap_utils import RelayPayload
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    device = scheduler.device
    batch = ScheduleBatch.init_new(
        reqs=reqs, req_to_token_pool=scheduler.req_to_token_pool,
        token_to_kv_pool_allocator=scheduler.token_to_kv_pool_allocator,
        tree_cache=scheduler.tree_cache, model_config=scheduler.model_config,
        enable_overlap=scheduler.enable_overlap, spec_algorithm=scheduler.spec_algorithm)
    rows = [req.kv.req_pool_idx for req in reqs]
    batch.req_pool_indices = torch.tensor(rows, dtype=torch.int64, device=device)
    batch.req_pool_indices_cpu = torch.tensor(rows, dtype=torch.int64)
    lengths = [len(req.origin_input_ids) + len(req.output_ids) - 1 for req in reqs]
    batch.seq_lens = torch.tensor(lengths, dtype=torch.int64, device=device)
    batch.seq_lens_cpu = torch.tensor(lengths, dtype=torch.int64)
    batch.orig_seq_lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    batch.seq_lens_sum = sum(lengths)
    batch.multimodal_inputs = [req.multimodal_inputs for req in reqs]
    batch.forward_mode = ForwardMode.DECODE
    last = torch.tensor([req.output_ids[-1] for req in reqs], dtype=torch.int64, device=device)
    scheduler.future_map.stash(batch.req_pool_indices, RelayPayload(bonus_tokens=last))
    batch.input_ids = None
    batch.sampling_info = SamplingBatchInfo.from_schedule_batch(
        batch, scheduler.model_config.vocab_size)
    return batch
