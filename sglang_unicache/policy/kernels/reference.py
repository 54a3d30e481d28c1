"""Torch reference of the hot-path ops: the CPU path and the oracle of the Triton kernels.

Observation-window statistics are computed in bounded memory: keys are processed in column chunks
of ``chunk`` tokens, so the largest temporary is ``[H, G, W, chunk]`` (never ``[heads, T, T]``).
Two passes: ``window_lse`` (softmax normalisers), then ``window_colsum`` (probabilities reduced over
queries). Causality: query at position p sees keys at positions <= p. When the whole request fits
in one chunk, ``PlanContext`` computes ``causal_logits`` once per layer and derives every statistic
from it (``window_signals``, ``lse_from_logits``, ``colsum_from_logits``,
``attend_from_logits``).
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def _logits(q: Tensor, k: Tensor, scale: float) -> Tensor:
    """q ``[W, H*G, D]``, k ``[C, H, D]`` -> fp32 logits ``[H, G, W, C]``.

    One bmm over ``[H, G*W, D] x [H, D, C]``: K is never expanded over the group.
    """
    w, hq, d = q.shape
    c, h, _ = k.shape
    g = hq // h
    qh = q.float().reshape(w, h, g, d).permute(1, 2, 0, 3).reshape(h, g * w, d)
    kh = k.float().permute(1, 2, 0)  # [H, D, C]
    return torch.bmm(qh, kh).mul_(scale).view(h, g, w, c)


def _allowed(q_pos: Tensor, start: int, stop: int, col_mask: Tensor | None, h: int) -> Tensor:
    """Boolean ``[H or 1, 1, W, C]`` of visible (causal and column-allowed) entries."""
    cols = torch.arange(start, stop, device=q_pos.device)
    allowed = (cols[None, :] <= q_pos[:, None])[None, None]  # [1, 1, W, C]
    if col_mask is not None:
        cm = col_mask[..., start:stop]
        cm = cm.reshape(1, 1, 1, -1) if cm.dim() == 1 else cm.reshape(h, 1, 1, -1)
        allowed = allowed & cm
    return allowed


def causal_logits(
    q: Tensor, k: Tensor, scale: float, q_pos: Tensor, start: int = 0, stop: int | None = None
) -> Tensor:
    """Logits ``[H, G, W, C]`` of keys ``start:stop`` with non-causal entries at ``-inf``."""
    stop = k.shape[0] if stop is None else stop
    logits = _logits(q, k[start:stop], scale)
    return logits.masked_fill_(~_allowed(q_pos, start, stop, None, k.shape[1]), float("-inf"))


def _col(col_mask: Tensor | None, h: int, start: int, stop: int) -> Tensor | None:
    if col_mask is None:
        return None
    cm = col_mask[..., start:stop]
    return cm.reshape(1, 1, 1, -1) if cm.dim() == 1 else cm.reshape(h, 1, 1, -1)


def lse_from_logits(logits: Tensor, col_mask: Tensor | None = None, start: int = 0) -> Tensor:
    """``[H, G, W]`` log-sum-exp of causal logits ``[H, G, W, C]`` over allowed columns."""
    cm = _col(col_mask, logits.shape[0], start, start + logits.shape[-1])
    if cm is not None:
        logits = logits.masked_fill(~cm, float("-inf"))
    return torch.logsumexp(logits, dim=-1)


def probs_from_logits(logits: Tensor, lse: Tensor) -> Tensor:
    """``[H, G, W, C]`` softmax probabilities of logits normalised by ``lse`` (-inf -> 0)."""
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1)
    return torch.exp(logits - safe)


WINDOW_SIGNALS = ("received", "received_text", "visual_share")  # what ``window_signals`` returns


def window_signals(
    logits: Tensor, is_visual: Tensor, query_weight: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The scorers' window signals of one layer from its causal logits ``[H, G, W, T]``:
    ``(received [H, T], received_text [H, T], visual_share [H, W])``, the mean attention each
    key receives from every observation query and from the queries weighted by
    ``query_weight [W]`` (the text ones), and each query's share of attention on ``is_visual
    [T]`` keys (averaged over its group). Layers stacked in front give each layer's numbers.
    One pass of exponentials: the softmax is never materialised; its normalisers and the
    visual mass are one product of the exponentials with ``[1 | is_visual]``, the column sums
    one product with the queries' weights over their normalisers."""
    *lead, h, g, w, t = logits.shape
    top = logits.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # a row that sees nothing
    e = torch.exp(logits - top).view(-1, g * w, t)  # [L'H, G*W, T]
    vis = is_visual.float()
    sums = e @ torch.stack([torch.ones_like(vis), vis], 1)  # [L'H, G*W, 2]
    total = sums[..., 0]
    inv = torch.where(total > 0, 1.0 / total, torch.zeros_like(total))
    share = (sums[..., 1] * inv).view(*lead, h, g, w).mean(dim=-2)
    rw = query_weight.float().repeat(g)
    weights = torch.stack([inv / (w * g), inv * rw / (rw.sum().clamp_min(1.0))], 1)
    cols = torch.bmm(weights, e).view(*lead, h, 2, t)
    return cols[..., 0, :], cols[..., 1, :], share


def colsum_from_probs(
    p: Tensor,
    col_mask: Tensor | None = None,
    row_weight: Tensor | None = None,
    start: int = 0,
) -> Tensor:
    """``[H, C]``: probabilities ``[H, G, W, C]`` summed over group heads and queries weighted by
    ``row_weight`` (``[W]`` or ``[H, W]``), columns outside ``col_mask`` zeroed."""
    h, _, w, c = p.shape
    cm = _col(col_mask, h, start, start + c)
    if cm is not None:
        p = p.masked_fill(~cm, 0.0)
    if row_weight is None:
        return p.sum(dim=(1, 2))
    rw = row_weight.float()
    rw = rw.reshape(1, 1, w, 1) if rw.dim() == 1 else rw.reshape(h, 1, w, 1)
    return (p * rw).sum(dim=(1, 2))


def colsum_from_logits(
    logits: Tensor,
    lse: Tensor,
    col_mask: Tensor | None = None,
    row_weight: Tensor | None = None,
    start: int = 0,
) -> Tensor:
    """``[H, C]``: softmax probabilities (normalised by ``lse``) summed over group heads and
    queries weighted by ``row_weight`` (``[W]`` or ``[H, W]``)."""
    return colsum_from_probs(probs_from_logits(logits, lse), col_mask, row_weight, start)


def attend_from_logits(logits: Tensor, lse: Tensor, v: Tensor) -> Tensor:
    """``[H, G, W, D]`` attention output of logits ``[H, G, W, C]`` (normalised by ``lse``) over
    values ``[C, H, D]``; a row at ``-inf`` everywhere gives zeros."""
    return torch.einsum("hgwc,chd->hgwd", probs_from_logits(logits, lse), v.float())


def window_lse(
    q: Tensor,
    k: Tensor,
    scale: float,
    q_pos: Tensor,
    col_mask: Tensor | None = None,
    chunk: int = 8192,
) -> Tensor:
    """Log-sum-exp of each observation query's logits over its visible keys: ``[H, G, W]`` fp32.

    q ``[W, Hq, D]``, k ``[T, H, D]``, q_pos ``[W]`` int, col_mask ``[T]`` or ``[H, T]`` bool.
    Rows with no visible key get ``-inf``. Keys are processed ``chunk`` at a time.
    """
    t, h, _ = k.shape
    w, hq, _ = q.shape
    out = torch.full((h, hq // h, w), float("-inf"), device=q.device)
    for start in range(0, t, chunk):
        stop = min(t, start + chunk)
        logits = causal_logits(q, k, scale, q_pos, start, stop)
        out = torch.logaddexp(out, lse_from_logits(logits, col_mask, start))
    return out


def window_attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    q_pos: Tensor,
    col_mask: Tensor | None = None,
    chunk: int = 8192,
) -> tuple[Tensor, Tensor]:
    """Attention output and normaliser of each observation query over its visible keys.

    q ``[W, Hq, D]``, k/v ``[T, H, D]``, col_mask ``[T]`` bool. Returns ``(out [H, G, W, D],
    lse [H, G, W])`` fp32 (an online softmax over key chunks); rows with no visible key get a zero
    output and ``-inf``.
    """
    t, h, d = k.shape
    w, hq, _ = q.shape
    lse = torch.full((h, hq // h, w), float("-inf"), device=q.device)
    out = torch.zeros(h, hq // h, w, v.shape[-1], device=q.device)
    for start in range(0, t, chunk):
        stop = min(t, start + chunk)
        logits = causal_logits(q, k, scale, q_pos, start, stop)
        cm = _col(col_mask, h, start, stop)
        if cm is not None:
            logits = logits.masked_fill(~cm, float("-inf"))
        part_lse = torch.logsumexp(logits, dim=-1)
        new = torch.logaddexp(lse, part_lse)
        safe = torch.where(torch.isfinite(new), new, torch.zeros_like(new))
        p = torch.exp(logits - safe.unsqueeze(-1))  # [H, G, W, C]
        part = torch.einsum("hgwc,chd->hgwd", p, v[start:stop].float())
        out = out * torch.exp(lse - safe).nan_to_num(0.0).unsqueeze(-1) + part
        lse = new
    return out, lse


def window_colsum(
    q: Tensor,
    k: Tensor,
    scale: float,
    q_pos: Tensor,
    lse: Tensor,
    col_mask: Tensor | None = None,
    row_weight: Tensor | None = None,
    chunk: int = 8192,
) -> Tensor:
    """Attention each key receives, summed over query heads of its group and weighted queries.

    Returns ``[H, T]`` fp32 with ``out[h, t] = sum_{g, w} row_weight[h, w] * p[h, g, w, t]`` where
    ``p`` is the softmax over visible keys (normalised by ``lse`` from ``window_lse`` with the same
    ``col_mask``). row_weight ``[W]`` or ``[H, W]``, default ones.
    """
    t, h, _ = k.shape
    out = torch.empty(h, t, device=q.device)
    for start in range(0, t, chunk):
        stop = min(t, start + chunk)
        logits = causal_logits(q, k, scale, q_pos, start, stop)
        out[:, start:stop] = colsum_from_logits(logits, lse, col_mask, row_weight, start)
    return out


def gather_heads(x: Tensor, kept: Tensor) -> Tensor:
    """Per-head gather: x ``[N, H, D]``, kept ``[H, K]`` -> ``[K, H, D]`` (exact copies)."""
    return x[kept.T.contiguous(), torch.arange(x.shape[1], device=x.device)]


def merge_gather(x: Tensor, kept: Tensor, assign: Tensor, weight: Tensor) -> Tensor:
    """Compressed entries of one layer: ``[K, H, D]`` in x's dtype (seed §6.2).

    x ``[N, H, D]`` span tokens, or ``[N, H, R, D]`` for R tensors merged alike (K and V: one
    call, each row's norm restored on its own); kept ``[H, K]``; assign ``[H, N]`` (entry or
    -1); weight ``[H, N]``.
    An entry with one member is an exact copy of its source token. An entry with several members is
    their weighted mean, rescaled to the weighted mean of the members' L2 norms ("norm restored to
    the group's scale"; averaging shrinks vectors that point in different directions).
    Members are gathered with ``index_select`` and summed with ``index_add_`` along rows (a
    boolean mask over the token-major layout and ``index_put_`` cost 3-4x more on CPU).
    """
    if x.dim() == 3:
        return merge_gather(x.unsqueeze(2), kept, assign, weight).squeeze(2)
    n, h, r, d = x.shape
    kk = kept.shape[1]
    heads = torch.arange(h, device=x.device)
    out = x[kept.T.contiguous(), heads]  # [K, H, R, D] exact copies
    valid = assign >= 0
    entry = assign.long() + heads.unsqueeze(1) * kk  # [H, N] index of (head, entry)
    count = torch.bincount(entry[valid], minlength=h * kk)
    is_multi = count > 1
    multi = is_multi.nonzero().flatten()
    if multi.numel() == 0:  # nothing merged: every entry is its copy
        return out
    # Only the members of entries with several members are averaged; they are visited head by
    # head in token order, so each sum is the same sequence of additions whatever the other
    # entries hold.
    shared = (valid & (count[torch.where(valid, entry, 0)] > 1)).flatten().nonzero().flatten()
    flat = (torch.cumsum(is_multi, 0) - 1)[entry.flatten()[shared]]  # among the merged entries
    w = weight.float().flatten()[shared].unsqueeze(1)  # [M, 1]
    rows = (shared % n) * h + shared // n  # (head, token) -> row of x as [N * H, R * D]
    src = x.reshape(n * h, r * d).index_select(0, rows).float()  # [M, R * D]: 2-D is fastest
    m = multi.numel()
    summed = torch.zeros(m, r * d, device=x.device).index_add_(0, flat, src * w)
    norms = src.view(-1, r, d).norm(dim=-1) * w  # [M, R]
    target = torch.zeros(m, r, device=x.device).index_add_(0, flat, norms)
    summed = summed.view(m, r, d)
    scale = target / summed.norm(dim=-1).clamp_min(1e-12)
    at = (multi % kk) * h + multi // kk  # (head, entry) -> row of out
    out.view(kk * h, r, d).index_copy_(0, at, (summed * scale.unsqueeze(-1)).to(x.dtype))
    return out
