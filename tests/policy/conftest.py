"""Shared fixtures of the policy tests: small synthetic requests (CPU, fast, seeded)."""

from __future__ import annotations

import pytest
import torch

from sglang_unicache.policy.inputs import ImageSpan, ScoreInputs


def make_inputs(
    layers: int = 3,
    tokens: int = 120,
    kv_heads: int = 2,
    group: int = 2,
    head_dim: int = 16,
    window: int = 6,
    spans: tuple[tuple[int, int], ...] = ((4, 54), (60, 108)),
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    protected: tuple[int, ...] = (),
) -> ScoreInputs:
    """A request with image spans, random K/V with smooth (redundant) image regions, and
    observation queries that attend strongly to a few planted image tokens."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(layers, tokens, kv_heads, head_dim, generator=g)
    v = torch.randn(layers, tokens, kv_heads, head_dim, generator=g)
    for a, b in spans:  # neighbouring patches alike -> redundancy
        base = torch.randn(layers, 1, kv_heads, head_dim, generator=g)
        k[:, a:b] = 0.6 * k[:, a:b] + 0.8 * base
        v[:, a:b] = 0.6 * v[:, a:b] + 0.8 * base
    q = torch.randn(layers, window, kv_heads * group, head_dim, generator=g)
    for a, _ in spans:  # plant a distinct "object" at a+3 of each span; queries point at it
        k[:, a + 3] = 1.5 * torch.randn(layers, kv_heads, head_dim, generator=g)
        q += 0.5 * k[:, a + 3].repeat_interleave(group, dim=1).unsqueeze(1)
    prot = None
    if protected:
        prot = torch.zeros(tokens, dtype=torch.bool)
        prot[list(protected)] = True
    return ScoreInputs(
        keys=k.to(dtype),
        values=v.to(dtype),
        spans=[ImageSpan(a, b) for a, b in spans],
        obs_queries=q.to(dtype),
        protected=prot,
    )


def window_case(seed: int = 0):
    """Odd-shaped window-statistics case shared by the reference and Triton tests."""
    g = torch.Generator().manual_seed(seed)
    w, h, grp, d, t = 5, 3, 2, 12, 37  # odd shapes
    q = torch.randn(w, h * grp, d, generator=g)
    k = torch.randn(t, h, d, generator=g)
    pos = torch.tensor([20, 30, 34, 35, 36])
    col = torch.rand(h, t, generator=g) > 0.3
    rw = torch.rand(h, w, generator=g)
    return q, k, pos, col, rw


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: intra-op threads only add contention (100x slower on a busy 2-core box)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
