"""KL self-check of a plan (UniCache seed 000 §7.1): does attention still look the same?

Seed: the KL divergence between the attention distributions of the last layers before and after
compression; above 0.1 the compression went too far -> the caller keeps the full KV (fallback).

The two distributions live on different supports (T keys vs the compressed set), so we compare on
the original tokens: the compressed distribution Q is spread back onto source tokens (entry j's
probability split among its members by their merge weights; evicted tokens get 0) and we compute
``KL(Q~ || P)`` against the full attention P. It is always finite (Q~ is supported on tokens P
sees) and, for pure eviction, equals ``-log(attention mass of the kept tokens)``: 0.1 means ~9.5% of
the attention mass was lost. Averaged over observation queries and query heads, maximum over the
checked layers (the last ``selfcheck_layers``).

Only observation queries that see each compressed span either fully or not at all are used (a
query inside a span would see a partial span); with none left the check reports ``checked=False``
and passes. Memory: ``[H, G, W, N]`` per span, never ``[T, T]``.
"""

from __future__ import annotations

import torch

from ..kernels.reference import _logits, lse_from_logits, window_lse
from ..reducers.apply import execute_layer
from ..types import CompressionPlan, SelfCheckResult

Tensor = torch.Tensor


def layer_kl(ctx, layer: int, plans: list[CompressionPlan]) -> Tensor | None:  # noqa: ANN001
    """Mean ``KL(Q~ || P)`` over valid queries and heads for one layer, or None (no valid query)."""
    inp = ctx.inputs
    q = inp.obs_queries[layer]
    pos = ctx.obs_positions
    plans = [p for p in plans if not p.skipped]
    valid = torch.ones_like(pos, dtype=torch.bool)
    for p in plans:
        valid &= (pos >= p.span.end - 1) | (pos < p.span.start)
    if not plans or not bool(valid.any()):
        return None
    q, pos = q[valid], pos[valid]
    keys_full = inp.keys[layer]
    compressed = torch.zeros(inp.num_tokens, dtype=torch.bool, device=keys_full.device)
    for p in plans:
        compressed[p.span.start : p.span.end] = True
    chunk = ctx.config.stats_chunk
    full = None if ctx.config.head_merge else ctx.logits(layer)  # logits of the original keys
    if full is not None:
        full = full[:, :, valid]
        lse_p = torch.logsumexp(full, dim=-1)  # [H, G, W]
        lse_rest = lse_from_logits(full, ~compressed)
    else:
        lse_p = window_lse(q, keys_full, inp.scale, pos, None, chunk)
        lse_rest = window_lse(q, keys_full, inp.scale, pos, ~compressed, chunk)
    parts = []
    for p in plans:
        sl = slice(p.span.start, p.span.end)
        lp = p.layers[layer]
        k_c, _ = execute_layer(lp, ctx.keys(layer)[sl], ctx.values(layer)[sl])
        sees = (pos >= p.span.end - 1).view(1, 1, -1, 1)
        if full is not None:
            l_orig = full[..., sl]
        else:
            l_orig = _logits(q, keys_full[sl], inp.scale).masked_fill(~sees, float("-inf"))
        l_comp = _logits(q, k_c, inp.scale).masked_fill(~sees, float("-inf"))
        parts.append((lp, l_orig, l_comp))
    lse_q = lse_rest
    for _, _, l_comp in parts:
        lse_q = torch.logaddexp(lse_q, torch.logsumexp(l_comp, dim=-1))
    kl = torch.exp(lse_rest - lse_q).nan_to_num(0.0) * (lse_p - lse_q)
    for lp, l_orig, l_comp in parts:
        log_qc = l_comp - lse_q.unsqueeze(-1)  # [H, G, W, K]
        h, g, w, _ = log_qc.shape
        idx = lp.assign.long().clamp_min(0).view(h, 1, 1, -1).expand(h, g, w, -1)
        log_q_member = torch.gather(log_qc, 3, idx)  # [H, G, W, N]
        wt = lp.weight.float().view(h, 1, 1, -1)
        member = (lp.assign >= 0).view(h, 1, 1, -1)
        log_qt = log_q_member + torch.log(wt.clamp_min(1e-30))
        log_p = l_orig - lse_p.unsqueeze(-1)
        term = torch.exp(log_qt) * (log_qt - log_p)
        kl = kl + torch.where(member & torch.isfinite(term), term, torch.zeros_like(term)).sum(-1)
    return kl.mean()


def self_check(ctx, plans: list[CompressionPlan]) -> SelfCheckResult:  # noqa: ANN001
    """Run the §7.1 check over the last ``selfcheck_layers`` layers."""
    cfg = ctx.config
    n = ctx.num_layers
    layers = tuple(range(max(0, n - cfg.selfcheck_layers), n))
    if not ctx.has_queries:
        return SelfCheckResult(0.0, cfg.kl_threshold, layers, False, True)
    kls = [v for v in (layer_kl(ctx, li, plans) for li in layers) if v is not None]
    if not kls:
        return SelfCheckResult(0.0, cfg.kl_threshold, layers, False, True)
    kl = float(torch.stack(kls).max())  # one host sync per request, after all layers
    return SelfCheckResult(kl, cfg.kl_threshold, layers, True, kl <= cfg.kl_threshold)
