"""One matrix over every registered method x keep ratio x dtype x GQA shape.

Invariants: exact budgets, protected tokens kept, ratio 1.0 is the identity, deterministic,
byte accounting equals the tensors, plans survive serialization. A new method is covered by
registering it.
"""

from __future__ import annotations

import io

import pytest
import torch

from sglang_unicache.policy.compressor import execute
from sglang_unicache.policy.config import UniCacheConfig
from sglang_unicache.policy.plans import CompressionPlan
from sglang_unicache.policy.registry import build_method, known_methods

from .conftest import make_inputs

RATIOS = (1.0, 0.5, 0.1, 0.01)
DTYPES = (torch.float32, torch.bfloat16)
SHAPES = ((2, 1), (2, 4))  # (kv_heads, group): MHA-like and GQA
PROTECTED = (6, 70)  # one caller-protected token in each span


def _plan(method: str, ratio: float, dtype: torch.dtype, shape: tuple[int, int]):
    inp = make_inputs(kv_heads=shape[0], group=shape[1], dtype=dtype, protected=PROTECTED)
    cfg = UniCacheConfig(method=method, keep_ratio=ratio)
    return inp, cfg, build_method(cfg).plan(inp)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"H{s[0]}G{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("method", known_methods())
def test_invariants(method: str, ratio: float, dtype: torch.dtype, shape: tuple[int, int]) -> None:
    inp, cfg, rplan = _plan(method, ratio, dtype, shape)
    h = inp.num_kv_heads
    assert len(rplan.spans) == len(inp.spans)
    for plan in rplan.spans:
        n = plan.span.length
        # the ratio the plan settled on (a failed self-check escalates it, never lowers it)
        assert rplan.keep_ratio >= ratio
        k_req = n if method == "full" else cfg.replace(keep_ratio=rplan.keep_ratio).span_budget(n)
        budgets = [lp.budget for lp in plan.layers]
        # budget honoured exactly: per-layer counts are the budgets and average to K
        assert sum(budgets) == k_req * inp.num_layers
        assert plan.physical_slots == max(budgets)
        for lp in plan.layers:
            assert lp.kept.shape == (h, lp.budget)
            assert torch.all(lp.kept[:, 1:] > lp.kept[:, :-1]), "kept must be strictly ascending"
            assert int(lp.kept.min()) >= 0 and int(lp.kept.max()) < n
            rows = torch.arange(h).unsqueeze(1)
            assert torch.equal(
                lp.assign[rows, lp.kept].long(), torch.arange(lp.budget).expand(h, -1)
            )
            sums = torch.zeros(h, lp.budget).scatter_add_(
                1, lp.assign.long().clamp_min(0), lp.weight
            )
            torch.testing.assert_close(sums, torch.ones(h, lp.budget))
            # protected never evicted (caller protection and alignment protection)
            for p in plan.protected.tolist():
                assert bool((lp.kept == p).any(dim=1).all()), f"protected {p} evicted"
        user = [p - plan.span.start for p in PROTECTED if plan.span.start <= p < plan.span.end]
        assert set(user) <= set(plan.protected.tolist())
        out = execute(plan, inp.keys, inp.values)
        assert [t.shape[0] for t in out.keys] == budgets
        assert all(t.dtype == dtype for t in out.keys + out.values)
        # byte accounting matches the tensors
        elt = torch.empty((), dtype=dtype).element_size()
        assert out.nbytes == plan.bytes.nominal
        assert plan.bytes.full == 2 * inp.num_layers * n * h * inp.head_dim * elt
        assert (
            plan.bytes.physical == 2 * inp.num_layers * plan.physical_slots * h * inp.head_dim * elt
        )
        if ratio == 1.0:  # identity
            for li in range(inp.num_layers):
                sl = slice(plan.span.start, plan.span.end)
                assert torch.equal(out.keys[li], inp.keys[li][sl])
                assert torch.equal(out.values[li], inp.values[li][sl])
            assert plan.bytes.nominal == plan.bytes.full
    if rplan.selfcheck is not None and ratio == 1.0:
        assert rplan.selfcheck.passed and rplan.selfcheck.kl < 1e-4


@pytest.mark.parametrize("method", known_methods())
def test_deterministic_and_serializable(method: str) -> None:
    _, _, a = _plan(method, 0.1, torch.float32, (2, 2))
    inp, _, b = _plan(method, 0.1, torch.float32, (2, 2))
    for pa, pb in zip(a.spans, b.spans, strict=True):
        for la, lb in zip(pa.layers, pb.layers, strict=True):
            assert torch.equal(la.kept, lb.kept) and torch.equal(la.assign, lb.assign)
            assert torch.equal(la.weight, lb.weight)
        buf = io.BytesIO()
        torch.save(pa.to_dict(), buf)
        buf.seek(0)
        back = CompressionPlan.from_dict(torch.load(buf, weights_only=True))
        assert back.bytes == pa.bytes and back.span == pa.span
        assert back.selfcheck == pa.selfcheck
        ka = execute(pa, inp.keys, inp.values).keys
        kb = execute(back, inp.keys, inp.values).keys
        assert all(torch.equal(x, y) for x, y in zip(ka, kb, strict=True))


@pytest.mark.parametrize("mode,bits", [("int8", 8), ("int4", 4)])
def test_quantized_bytes_match_payload(mode: str, bits: int) -> None:
    inp = make_inputs()
    cfg = UniCacheConfig(keep_ratio=0.2, quantization=mode)
    plan = build_method(cfg).plan(inp).spans[0]
    out = execute(plan, inp.keys, inp.values)
    assert out.quantized_nbytes == plan.bytes.quantized > 0
    assert plan.bytes.quantized < plan.bytes.nominal
