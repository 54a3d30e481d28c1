"""The executor: turn a ``CompressionPlan`` into compressed K/V (seed §6.2, §6.3, §3).

Per layer: head merging (if the plan recorded it), then per head gather of the kept tokens and
weighted merge of folded tokens (same weights for K and V, norm restored; ``merge_gather``), then
optional per-head int8/int4 quantization. Inputs are never modified.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sglang_unicache.policy.heads import apply_head_merge
from sglang_unicache.policy.kernels.reference import gather_heads, merge_gather
from sglang_unicache.policy.plans import CompressedKV, CompressionPlan, LayerPlan
from sglang_unicache.policy.quantize import bits_of, dequantize, quantize

Tensor = torch.Tensor


def span_slice(plan: CompressionPlan, x: Tensor, span_local: bool | None) -> Tensor:
    """The span's rows of ``x``: ``x`` is either the whole request ``[T, H, D]`` or already the span
    ``[N, H, D]`` (``span_local=None`` decides by length)."""
    n = plan.span.length
    if span_local is None:
        span_local = x.shape[0] == n
    return x if span_local else x[plan.span.start : plan.span.end]


def execute_layer(lp: LayerPlan, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Compressed ``([K_l, H, D], [K_l, H, D])`` of one layer from the span's ``[N, H, D]`` K/V."""
    merged = lp.merges and lp.num_kept != k.shape[0]
    if merged and k.shape == v.shape and k.dtype == v.dtype:  # one call merges both alike
        if lp.head_map is not None:
            k = apply_head_merge(k, lp.head_map, lp.head_weight)
            v = apply_head_merge(v, lp.head_map, lp.head_weight)
        kv = merge_gather(torch.stack([k, v], 2), lp.kept, lp.assign, lp.weight)
        return kv[:, :, 0].contiguous(), kv[:, :, 1].contiguous()
    return execute_one(lp, k), execute_one(lp, v)


def execute_one(lp: LayerPlan, x: Tensor) -> Tensor:
    """One of a layer's compressed tensors ``[K_l, H, D]`` (keys or values) from the span's
    ``[N, H, D]``: ``execute_layer``'s, alone (the self-check's KL reads the keys only)."""
    if lp.head_map is not None:
        x = apply_head_merge(x, lp.head_map, lp.head_weight)
    if lp.num_kept == x.shape[0]:  # every token kept (kept is sorted and unique): identity
        return x.clone()
    if not lp.merges:  # eviction only: a per-head gather
        return gather_heads(x, lp.kept)
    return merge_gather(x, lp.kept, lp.assign, lp.weight)


def execute(
    plan: CompressionPlan,
    keys: Sequence[Tensor] | Tensor,
    values: Sequence[Tensor] | Tensor,
    quantization: str | None = None,
    span_local: bool | None = None,
) -> CompressedKV:
    """Compressed K/V of one span, per layer ``[K_l, H, D]`` in the input dtype.

    keys/values: per layer ``[T, H, D]`` of the request or ``[N, H, D]`` of the span (or stacked).
    quantization: "off" | "int8" | "int4", default the plan's. When on, the returned dense tensors
    are the dequantized values (what attention will see) and the payload is attached.
    """
    mode = plan.quantization if quantization is None else quantization
    if mode == "off":
        stacked = execute_stacked(plan, keys, values, span_local)
        if stacked is not None:
            return stacked
    ks, vs, qk, qv = [], [], [], []
    for li, lp in enumerate(plan.layers):
        k, v = execute_layer(
            lp, span_slice(plan, keys[li], span_local), span_slice(plan, values[li], span_local)
        )
        if mode != "off":
            bits = bits_of(mode)
            qk.append(quantize(k, bits))
            qv.append(quantize(v, bits))
            k, v = dequantize(qk[-1], k.dtype), dequantize(qv[-1], v.dtype)
        ks.append(k)
        vs.append(v)
    if mode == "off":
        return CompressedKV(ks, vs)
    return CompressedKV(ks, vs, qk, qv)


def execute_stacked(
    plan: CompressionPlan,
    keys: Sequence[Tensor] | Tensor,
    values: Sequence[Tensor] | Tensor,
    span_local: bool | None = None,
) -> CompressedKV | None:
    """``execute`` of a span whose layers all merge and keep the same count (``layer_fill``
    "next", the server's setting), in one ``merge_gather`` call: the layers side by side as
    heads. Each entry's sum is the same sequence of additions whatever the other heads hold,
    so the entries are exactly the per-layer ones, in one call instead of one per layer (a
    span's small gathers and sums cost their dispatch more than their work). None where the
    per-layer path must run (head merging, an eviction-only layer, counts that differ, every
    token kept)."""
    layers = plan.layers
    if not layers or any(not lp.merges or lp.head_map is not None for lp in layers):
        return None
    shape = layers[0].kept.shape
    if shape[1] == plan.span.length or any(lp.kept.shape != shape for lp in layers):
        return None  # decided before any layer is read (a pool's layers are gathered on read)
    ks = [span_slice(plan, keys[li], span_local) for li in range(len(layers))]
    vs = [span_slice(plan, values[li], span_local) for li in range(len(layers))]
    n, h, d = ks[0].shape
    if any(x.shape != ks[0].shape or x.dtype != ks[0].dtype for x in (*ks, *vs)):
        return None
    x = torch.stack([torch.stack(ks, 1), torch.stack(vs, 1)], 3)  # [N, L, H, 2, D]
    kv = merge_gather(x.view(n, len(layers) * h, 2, d),
                      torch.cat([lp.kept for lp in layers]),
                      torch.cat([lp.assign for lp in layers]),
                      torch.cat([lp.weight for lp in layers]))
    kv = kv.view(shape[1], len(layers), h, 2, d)
    return CompressedKV([kv[:, li, :, 0].contiguous() for li in range(len(layers))],
                        [kv[:, li, :, 1].contiguous() for li in range(len(layers))])
