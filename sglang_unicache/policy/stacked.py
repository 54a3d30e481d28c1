"""The per-layer signals of several layers in one pass: the same numbers, fewer operations.

``PlanContext`` computes every signal one layer at a time. A small request (two images of 256
tokens on an 8-layer model) costs about a thousand small tensor operations that way, each a
few microseconds of dispatch on a CPU and a kernel launch on a GPU; most of the plan's time.
Here the layers of a group are stacked along a leading dimension and each signal is computed
once for the group: the keys and values of every layer side by side in one buffer (normalised
in place into the unit K/V once the window logits are read from its keys), the window logits
in one buffer, the neighbour redundancy, the window signals (``window_signals``, which the
per-layer path calls on one layer's logits). Each layer's slice is stored in the context's
cache under the name its per-layer method uses, so the scorer's combination, the merge
reducer, the alignment scores and the self-check read them unchanged. The stacked operations
are the per-layer ones with a leading dimension: every value is the one the per-layer path
gives (``tests/policy/test_stacked.py`` compares them exactly).

Groups are consecutive layers whose temporaries fit ``GROUP_BYTES``; the per-layer path stays
for what this does not cover (head merging, a request longer than ``stats_chunk``, spans on a
patch grid, no observation queries).
"""

from __future__ import annotations

import torch

from sglang_unicache.policy import signals
from sglang_unicache.policy.kernels.reference import WINDOW_SIGNALS, window_signals

Tensor = torch.Tensor

GROUP_BYTES = 64 << 20  # the temporaries of one group of layers (fp32 logits, exponentials, K/V)


def layer_groups(ctx) -> list[range] | None:
    """Consecutive layers to compute together, or None where the per-layer path must run."""
    inp = ctx.inputs
    if (ctx.head_merge or not ctx.has_queries or inp.num_tokens > ctx.stats_chunk
            or any(s.grid is not None for s in inp.spans)):
        return None
    t, h, d = inp.num_tokens, inp.num_kv_heads, inp.head_dim
    w, hq = inp.obs_queries[0].shape[:2]
    per_layer = 4 * (3 * hq * w * t + 3 * t * h * 2 * d)
    size = max(1, min(inp.num_layers, GROUP_BYTES // per_layer))
    return [range(a, min(a + size, inp.num_layers)) for a in range(0, inp.num_layers, size)]


def fill(ctx, layers: range) -> dict[str, Tensor]:
    """Compute the signals of ``layers`` together and store each layer's slice in ``ctx``.

    Returns the stacked ``[g, H, T]`` key norms, redundancy, attention received (from every
    observation query and from the text ones) and the ``[g, H, W]`` visual share."""
    inp = ctx.inputs
    x = _stack_kv(inp, layers)  # [g, T, H, 2D] fp32: K | V
    q = _stack(inp.obs_queries, layers)  # [g, W, Hq, D]
    logits = _stacked_logits(q, x[..., : inp.head_dim], inp.scale, ctx.obs_positions)
    x, norms = signals.normalize_kv_(x)  # the unit K/V, in place, once the logits are read
    key_norm = norms[..., 0].transpose(1, 2).contiguous()
    redundancy = signals.raster_redundancy(x, ctx.run_id, ctx.redundancy_window)
    window = window_signals(logits, ctx.is_visual, ctx.query_is_text)
    named = {"unit_kv": x, "key_norm": key_norm, "redundancy": redundancy,
             **dict(zip(WINDOW_SIGNALS, window, strict=True))}
    for i, li in enumerate(layers):
        for name, value in named.items():
            ctx.store(name, li, value[i])
    for li in layers[-2:]:  # the context keeps the logits of the two latest layers
        ctx.keep_logits(li, logits[li - layers.start].clone())
    return named


def _stack_kv(inp, layers: range) -> Tensor:
    """Each layer's keys and values side by side in one fp32 buffer ``[g, T, H, 2D]``, one
    layer read at a time (a ``LayerView`` gathers each from the KV pool)."""
    d = inp.head_dim
    out = torch.empty(len(layers), inp.num_tokens, inp.num_kv_heads, 2 * d,
                      device=inp.device)
    for i, li in enumerate(layers):
        out[i, ..., :d] = inp.keys[li]
        out[i, ..., d:] = inp.values[li]
    return out


def _stack(per_layer, layers: range) -> Tensor:
    """``per_layer[li]`` for ``li`` in ``layers`` stacked."""
    return torch.stack([per_layer[li] for li in layers])


def _stacked_logits(q: Tensor, k: Tensor, scale: float, q_pos: Tensor) -> Tensor:
    """``causal_logits`` of every layer: q ``[g, W, Hq, D]``, k ``[g, T, H, D]`` -> fp32
    ``[g, H, G, W, T]``, each layer's product written into one buffer."""
    n, w, hq, d = q.shape
    t, h = k.shape[1:3]
    qh = q.float().reshape(n, w, h, hq // h, d).permute(0, 2, 3, 1, 4).reshape(n, h, -1, d)
    logits = torch.empty(n, h, hq // h * w, t, device=q.device)
    for i in range(n):  # one product per layer over the keys in place (no copy of K)
        torch.bmm(qh[i], k[i].float().permute(1, 2, 0), out=logits[i])
    logits = logits.mul_(scale).view(n, h, hq // h, w, t)
    allowed = torch.arange(t, device=q_pos.device)[None, :] <= q_pos[:, None]  # [W, T]
    return logits.masked_fill_(~allowed, float("-inf"))


__all__ = ["GROUP_BYTES", "fill", "layer_groups"]
