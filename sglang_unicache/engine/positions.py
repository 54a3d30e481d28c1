"""Positions after a compacted span keep their original (logical) values.

SGLang computes decode positions from the row length: M-RoPE models (Qwen2-VL, Qwen2.5-VL) use
``mrope_position_delta + seq_len - 1``. When a span of N tokens becomes K entries the row is
``N - K`` shorter, so the delta grows by ``N - K`` and the prompt's precomputed M-RoPE positions
lose the dropped columns (otherwise decode would read them as precomputed positions).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_unicache.engine.request import removed_of


@dataclass
class MropeBackup:
    """What ``shift_mrope`` changed, to restore a request that must be prefilled again."""

    positions: torch.Tensor | None
    delta: torch.Tensor | None


def shift_mrope(mm_inputs, keep: torch.Tensor, removed: int) -> MropeBackup:
    """Drop the compacted-away columns of ``mrope_positions`` and add ``removed`` to the delta.

    keep: ``[L]`` bool over the prompt positions that still have a row entry.
    """
    backup = MropeBackup(mm_inputs.mrope_positions, mm_inputs.mrope_position_delta)
    if mm_inputs.mrope_positions is not None:
        length = min(mm_inputs.mrope_positions.shape[1], keep.shape[0])
        mask = keep[:length].to(mm_inputs.mrope_positions.device)
        mm_inputs.mrope_positions = torch.cat(
            [mm_inputs.mrope_positions[:, :length][:, mask],
             mm_inputs.mrope_positions[:, length:]], dim=1)
    if mm_inputs.mrope_position_delta is not None:
        mm_inputs.mrope_position_delta = mm_inputs.mrope_position_delta + removed
    mm_inputs.mrope_position_delta_repeated_cache = None
    return backup


def restore_mrope(mm_inputs, backup: MropeBackup) -> None:
    mm_inputs.mrope_positions = backup.positions
    mm_inputs.mrope_position_delta = backup.delta
    mm_inputs.mrope_position_delta_repeated_cache = None


def shift_positions(forward_batch, reqs) -> None:
    """1-D RoPE models: add each request's removed-token count to its positions.

    SGLang derives 1-D positions from row lengths (extend: ``prefix_len + arange``, decode:
    ``seq_len - 1``). A request whose row holds compressed spans is ``request.removed_of(req)``
    tokens shorter than its prompt, so every token it computes after them is that much further
    along; the spans' own entries keep the positions baked into their (post-RoPE) keys.
    """
    offsets = [removed_of(req) for req in reqs]
    if not any(offsets) or forward_batch.positions is None:
        return
    positions = forward_batch.positions
    offset = torch.tensor(offsets, dtype=positions.dtype, device=positions.device)
    if forward_batch.forward_mode.is_decode():
        forward_batch.positions = positions + offset
    elif forward_batch.forward_mode.is_extend():
        counts = forward_batch.extend_seq_lens.to(positions.device).to(torch.int64)
        forward_batch.positions = positions + offset.repeat_interleave(counts)
