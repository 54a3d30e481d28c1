"""Small tensor helpers shared by the context and the parts: normalisation, redundancy, pooling,
positions.

All take and return fp32 tensors; none loops over tokens or heads in Python (loops are over the
neighbour offsets 1..k).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Tensor = torch.Tensor

RASTER_CHUNK = 128  # tokens per dot-product call of ``raster_redundancy``


def masked_minmax(x: Tensor, mask: Tensor | None) -> Tensor:
    """Min-max normalise ``x [..., H, T]`` to [0, 1] over the columns where ``mask [T]`` is True
    (None: every column), per row; other columns become 0. A constant row maps to 0.5 (no
    preference). Seed §2.3: attention is normalised *within* a modality, never globally."""
    if mask is None:
        lo = x.amin(dim=-1, keepdim=True)
        hi = x.amax(dim=-1, keepdim=True)
    else:
        big = torch.finfo(torch.float32).max
        m = mask.unsqueeze(0)
        lo = torch.where(m, x, big).amin(dim=-1, keepdim=True)
        hi = torch.where(m, x, -big).amax(dim=-1, keepdim=True)
    span = hi - lo
    out = torch.where(span > 1e-12, (x - lo) / span.clamp_min(1e-12), torch.full_like(x, 0.5))
    return out if mask is None else torch.where(m, out, torch.zeros_like(out))


def by_modality_minmax(x: Tensor, is_visual: Tensor) -> Tensor:
    """``masked_minmax`` applied separately to image and text columns."""
    return masked_minmax(x, is_visual) + masked_minmax(x, ~is_visual)


def unit_kv(keys: Tensor, values: Tensor) -> Tensor:
    """``[T, H, 2D]`` fp32: each token's unit key and unit value side by side, scaled so that
    the dot product of two rows is the mean of their key cosine and value cosine."""
    return unit_kv_norms(keys, values)[0]


def unit_kv_norms(keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
    """(``unit_kv``, ``[T, H, 2]`` the L2 norms of each key and value); keys and values
    ``[..., T, H, D]`` (layers stacked in front give each layer's numbers). One fp32 buffer
    normalised in place: the same numbers as ``F.normalize`` of K and V apart, concatenated."""
    return normalize_kv_(torch.cat([keys, values], -1).float())


def normalize_kv_(x: Tensor) -> tuple[Tensor, Tensor]:
    """``unit_kv_norms`` of ``x = [K | V]`` ``[..., 2D]`` fp32, normalised in place (a caller
    that already holds K and V side by side spares the concatenation)."""
    halves = x.view(*x.shape[:-1], 2, x.shape[-1] // 2)
    norms = halves.norm(dim=-1, keepdim=True)
    halves.div_(norms.clamp_min(1e-12))
    return x.div_(2**0.5), norms.squeeze(-1)


def neighbour_redundancy(keys: Tensor, values: Tensor, run_id: Tensor, k: int) -> Tensor:
    """Seed §4.2 redundancy d_i: mean cosine similarity of token i's K/V with its neighbours
    i-k..i+k inside the same run (image span or text run), clipped to [0, 1]. ``[H, T]`` fp32.

    K and V are L2-normalised separately and concatenated, so the similarity is the mean of the key
    cosine and the value cosine.
    """
    return raster_redundancy(unit_kv(keys, values), run_id, k)


def raster_redundancy(x: Tensor, run_id: Tensor, k: int) -> Tensor:
    """``neighbour_redundancy`` of ``x = unit_kv(keys, values)`` ``[..., T, H, 2D]`` (layers
    stacked in front give each layer's ``[H, T]``). Each offset's dot products are taken
    ``RASTER_CHUNK`` tokens at a time on a CPU, so the product's temporary stays in cache: the
    same numbers as one ``vecdot`` over every token, in about three quarters of its time (an
    accelerator takes each offset in one call)."""
    lead, (t, h, _) = x.shape[:-3], x.shape[-3:]
    x = x.reshape(-1, *x.shape[-3:])  # [L', T, H, 2D]
    total = torch.zeros(x.shape[0], t, h, device=x.device)
    count = torch.zeros(t, 1, device=x.device)
    buffer = torch.empty(x.shape[0], t, h, device=x.device)
    chunk = RASTER_CHUNK if x.device.type == "cpu" else t
    for off in range(1, min(k, t - 1) + 1):
        same = (run_id[off:] == run_id[:-off]).float().unsqueeze(-1)  # [T-off, 1]
        sim = buffer[:, : t - off]  # [L', T-off, H]: token i with token i + off
        for a in range(0, t - off, chunk):
            b = min(a + chunk, t - off)
            torch.linalg.vecdot(x[:, off + a : off + b], x[:, a:b], out=sim[:, a:b])
        sim.mul_(same)
        total[:, off:] += sim
        total[:, :-off] += sim
        count[off:] += same
        count[:-off] += same
    out = (total / count.clamp_min(1.0)).clamp(0.0, 1.0).transpose(1, 2).contiguous()
    return out.view(*lead, h, t)


def grid_redundancy(keys: Tensor, values: Tensor, cols: int, k: int) -> Tensor:
    """Seed §4.2 redundancy on a patch grid: mean K/V cosine to the neighbours up to ``k`` steps
    left/right in the same row and up/down in the same column. keys/values ``[N, H, D]`` with
    ``N % cols == 0`` (rows = N / cols; video frames stack as extra rows). ``[H, N]`` fp32."""
    return patch_grid_redundancy(unit_kv(keys, values), cols, k)


def patch_grid_redundancy(x: Tensor, cols: int, k: int) -> Tensor:
    """``grid_redundancy`` of ``x = unit_kv(keys, values)`` ``[N, H, 2D]``."""
    n, h, _ = x.shape
    x = x.view(n // cols, cols, h, -1)  # [R, C, H, 2D]
    total = torch.zeros(n // cols, cols, h, device=x.device)
    count = torch.zeros(n // cols, cols, 1, device=x.device)
    for off in range(1, k + 1):
        if off < cols:  # same row
            sim = torch.linalg.vecdot(x[:, off:], x[:, :-off])
            total[:, off:] += sim
            total[:, :-off] += sim
            count[:, off:] += 1
            count[:, :-off] += 1
        if off < n // cols:  # same column
            sim = torch.linalg.vecdot(x[off:], x[:-off])
            total[off:] += sim
            total[:-off] += sim
            count[off:] += 1
            count[:-off] += 1
    out = (total / count.clamp_min(1.0)).clamp(0.0, 1.0)
    return out.view(n, h).T.contiguous()


def run_position(run_id: Tensor) -> Tensor:
    """``[T]`` position of each token inside its run, scaled so the run's last token is 1."""
    t = run_id.shape[0]
    pos = torch.arange(t, device=run_id.device, dtype=torch.float32)
    n_runs = int(run_id.max()) + 1
    first = torch.full((n_runs,), float(t), device=run_id.device).scatter_reduce(
        0, run_id, pos, reduce="amin"
    )
    last = torch.zeros(n_runs, device=run_id.device).scatter_reduce(0, run_id, pos, reduce="amax")
    length = (last - first)[run_id]
    return torch.where(
        length > 0, (pos - first[run_id]) / length.clamp_min(1), torch.ones_like(pos)
    )


def max_pool_tokens(x: Tensor, kernel: int) -> Tensor:
    """SnapKV's clustering step: 1-D max pool over tokens, same length. ``x [H, T]``."""
    if kernel <= 1:
        return x
    return F.max_pool1d(x.unsqueeze(0), kernel, stride=1, padding=kernel // 2).squeeze(0)
