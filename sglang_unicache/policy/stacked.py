"""The per-layer signals of several layers in one pass: the same numbers, fewer operations.

``PlanContext`` computes every signal one layer at a time. A small request (two images of 256
tokens on an 8-layer model) costs about a thousand small tensor operations that way, each a
few microseconds of dispatch on a CPU and a kernel launch on a GPU; most of the plan's time.
Here the layers of a group are stacked along a leading dimension and each signal is computed
once for the group: the window logits of every layer written into one buffer, their
normalisers, probabilities and column sums, the unit K/V and the neighbour redundancy. Each
layer's slice is stored in the context's cache under the name its per-layer method uses, so
the scorer's combination, the merge reducer, the alignment scores and the self-check read them
unchanged. The stacked operations are the per-layer ones with a leading dimension: every value
is the one the per-layer path gives (``tests/policy/test_stacked.py`` compares them exactly).

Groups are consecutive layers whose temporaries fit ``GROUP_BYTES``; the per-layer path stays
for what this does not cover (head merging, a request longer than ``stats_chunk``, spans on a
patch grid, no observation queries).
"""

from __future__ import annotations

import torch

from sglang_unicache.policy import signals
from sglang_unicache.policy.kernels.reference import probs_from_logits

Tensor = torch.Tensor

GROUP_BYTES = 64 << 20  # the temporaries of one group of layers (fp32 logits, probabilities, K/V)


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
    keys, values = _stack(inp.keys, layers), _stack(inp.values, layers)  # [g, T, H, D]
    x, norms = signals.unit_kv_norms(keys, values)  # [g, T, H, 2D], [g, T, H, 2]
    key_norm = norms[..., 0].transpose(1, 2).contiguous()
    redundancy = signals.raster_redundancy(x, ctx.run_id, ctx.redundancy_window)
    q = _stack(inp.obs_queries, layers)  # [g, W, Hq, D]
    logits = _stacked_logits(q, keys, inp.scale, ctx.obs_positions)  # [g, H, G, W, T]
    lse_all = torch.logsumexp(logits, dim=-1)
    vis = ctx.is_visual.view(1, 1, 1, 1, -1)
    lse_vis = torch.logsumexp(logits.masked_fill(~vis, float("-inf")), dim=-1)
    p = probs_from_logits(logits, lse_all)
    g, w = ctx.group, ctx.obs_positions.numel()
    received = p.sum(dim=(2, 3)) / (w * g)
    rw = ctx.query_is_text.float()
    received_text = (p * rw.view(1, 1, 1, -1, 1)).sum(dim=(2, 3)) / (rw.sum().clamp_min(1.0) * g)
    share = torch.exp(lse_vis - lse_all).nan_to_num(0.0).mean(dim=2)
    for i, li in enumerate(layers):
        for name, value in (("unit_kv", x[i]), ("key_norm", key_norm[i]),
                            ("redundancy", redundancy[i]), ("lse_all", lse_all[i]),
                            ("lse_visual", lse_vis[i]), ("received", received[i]),
                            ("received_text", received_text[i]), ("visual_share", share[i])):
            ctx.store(name, li, value)
    for li in layers[-2:]:  # the context keeps the logits of the two latest layers
        ctx.keep_logits(li, logits[li - layers.start].clone())
    return {"key_norm": key_norm, "redundancy": redundancy, "received": received,
            "received_text": received_text, "visual_share": share}


def _stack(per_layer, layers: range) -> Tensor:
    """``per_layer[li]`` for ``li`` in ``layers`` stacked; one layer read at a time (a
    ``LayerView`` gathers each from the KV pool), so no more than one copy is alive beside the
    stack."""
    out = None
    for i, li in enumerate(layers):
        x = per_layer[li]
        if out is None:
            out = x.new_empty((len(layers), *x.shape))
        out[i] = x
    return out


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
