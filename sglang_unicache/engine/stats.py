"""The scheduler's counters: what the plugin did, for ``/server_info``, ``/metrics`` and the
benchmarks (``metrics.py`` names and explains each one exported)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Stats:
    images_compressed: int = 0
    requests_compressed: int = 0
    slots_freed: int = 0
    fallbacks: int = 0  # requests whose self-check failed even at escalate_max_keep: full KV kept
    escalations: int = 0  # keep-ratio rungs climbed after a failed self-check
    views_unchecked: int = 0  # requests planned at the top of their bounded ladder: no check
    errors: int = 0  # compressions that raised (on any tensor-parallel rank): full KV kept
    capture_missed: int = 0  # prefills whose attention ran past the query hook: full KV kept
    rank_disagreements: int = 0  # --tp-size: compressions the ranks did not do alike
    retracted: int = 0  # requests retracted by the scheduler (restored to their own ids)
    skipped_cached: int = 0
    spans_reused: int = 0  # compressed spans a later request decoded on (the device path)
    spans_recalled: int = 0  # images a later request got back in full from the host copies
    recall_history_tokens: int = 0  # tokens after a recalled image copied from the device path
    recall_bytes: int = 0  # host copy bytes loaded back onto the device
    recall_lost: int = 0  # recalls whose copy or room was gone at admission: prefilled instead
    images_prefilled: int = 0  # image spans a prefill computed (SGLang encodes exactly these)
    compress_seconds: float = 0.0  # policy + compaction, summed (benchmarks read it)
    # Its steps (``Compression._step``): gather + plan + self-check + execute; the host copy's
    # packing; write + compaction + rewrite. The rest is freeing, span metadata and the ranks'
    # verdicts.
    compress_plan_seconds: float = 0.0
    compress_copy_seconds: float = 0.0
    compress_apply_seconds: float = 0.0
    # The forwards of extend batches with a request that compresses at this chunk or a later one
    # (every chunk of a chunked prompt), summed, and the tokens they prefilled: what
    # compress_seconds is read against.
    prefill_seconds: float = 0.0
    prefill_tokens: int = 0

    def to_dict(self) -> dict[str, float]:
        return dict(self.__dict__)
