"""Pinned plans and the fast paths of planning against their plain definitions.

A small seeded bf16 request is planned with the defaults as shipped, with an escalating
self-check and with the check off; its kept entries, merges and verdict are pinned. Making
planning faster must leave them exactly as they are (the deciding statistic within 1e-5).
"""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.nn.functional as F

from sglang_unicache.policy import signals
from sglang_unicache.policy.checks import selfcheck
from sglang_unicache.policy.checks.selfcheck import key_coverage, reference_attention
from sglang_unicache.policy.compressor import Method
from sglang_unicache.policy.config import UniCacheConfig
from sglang_unicache.policy.context import PlanContext
from sglang_unicache.policy.inputs import ScoreInputs
from sglang_unicache.policy.kernels.reference import merge_gather
from sglang_unicache.policy.registry import build_method

from .conftest import make_inputs

SHIPPED = dict(layer_fill="next", selfcheck_content_threshold=1.0)
SPAN0_LAYER0_AT_01 = [[3, 33, 40, 42, 47], [3, 31, 37, 44, 49]]
SPAN1_LAYER3_AT_01 = [[3, 39, 43, 45, 46], [3, 36, 43, 45, 47]]
SPAN0_LAYER0_AT_04 = [
    [3, 24, 29, 30, 32, 33, 34, 35, 36, 38, 39, 40, 42, 43, 44, 45, 46, 47, 48, 49],
    [3, 11, 24, 26, 31, 34, 35, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49],
]
SPAN1_LAYER3_AT_04 = [
    [3, 28, 30, 31, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47],
    [3, 19, 26, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47],
]

# (config, keep ratio, escalations, verdict, kl, span 0 layer 0 kept, span 1 layer 3 kept,
#  merged members per layer of span 0, digest of every layer's kept and assign)
PINNED = {
    "shipped": (UniCacheConfig(**SHIPPED), 0.1, 0, True, 0.8152366, SPAN0_LAYER0_AT_01,
                SPAN1_LAYER3_AT_01, [0, 0, 4, 0], "b7bc063b51371c61"),
    "escalating": (UniCacheConfig(**SHIPPED, selfcheck_threshold=0.6, escalate_factor=2.0),
                   0.4, 2, True, 0.4035443,
                   SPAN0_LAYER0_AT_04, SPAN1_LAYER3_AT_04, [0, 0, 2, 0], "7ffa4dea340afa4c"),
    "check off": (UniCacheConfig(layer_fill="next", selfcheck=False), 0.1, 0, None, None,
                  SPAN0_LAYER0_AT_01, SPAN1_LAYER3_AT_01, [0, 0, 4, 0], "b7bc063b51371c61"),
}


def _digest(plan) -> str:
    kept = torch.cat([lp.kept.flatten() for p in plan.spans for lp in p.layers])
    assign = torch.cat([lp.assign.flatten() for p in plan.spans for lp in p.layers])
    raw = kept.to(torch.int64).numpy().tobytes() + assign.to(torch.int64).numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()[:16]


@pytest.mark.parametrize("name", sorted(PINNED))
def test_a_seeded_request_gets_its_pinned_plan(name: str) -> None:
    cfg, keep, escalations, passed, kl, span0, span1, merged, digest = PINNED[name]
    inp = make_inputs(layers=4, tokens=120, dtype=torch.bfloat16, seed=3)
    plan = build_method(cfg).plan(inp)
    assert plan.keep_ratio == pytest.approx(keep) and plan.escalations == escalations
    assert not plan.fallback
    if passed is None:
        assert plan.selfcheck is None
    else:
        assert plan.selfcheck.passed == passed and plan.selfcheck.statistic == "kl"
        assert plan.selfcheck.value == pytest.approx(kl, abs=1e-5)
        assert set(plan.selfcheck.stats) == {"kl", "kl_head"}  # what decides, content off
    assert plan.spans[0].layers[0].kept.tolist() == span0
    assert plan.spans[1].layers[3].kept.tolist() == span1
    assert [int((lp.assign >= 0).sum()) - lp.kept.numel() for lp in plan.spans[0].layers] == merged
    assert _digest(plan) == digest, "kept entries or merges of some layer changed"


def test_a_level_failing_its_kl_escalates_without_the_rest_of_the_check(monkeypatch) -> None:
    """Below the cap a level is first checked on its KL alone: the escalating request's two
    failed levels compute neither key_coverage nor the content layer's plan, and its plan and
    full report are those of checking every level in full. (With only what decides computed,
    the default, no level computes key_coverage.)"""
    cfg = PINNED["escalating"][0].replace(selfcheck_all_statistics=True)
    inp = make_inputs(layers=4, tokens=120, dtype=torch.bfloat16, seed=3)
    calls = []
    real = selfcheck.key_coverage
    monkeypatch.setattr(selfcheck, "key_coverage", lambda *a: calls.append(1) or real(*a))
    fast = build_method(cfg).plan(inp)
    spans_checked = 2 * len(inp.spans)  # the last two layers, each span, once: the cap level
    assert fast.escalations == 2 and len(calls) == spans_checked

    calls.clear()
    monkeypatch.setattr(selfcheck.SelfCheck, "kl_check", lambda *a, **k: None)
    full = build_method(cfg).plan(inp)
    assert len(calls) == 3 * spans_checked  # every level checked in full
    assert _digest(fast) == _digest(full) and fast.keep_ratio == full.keep_ratio
    assert fast.selfcheck.passed == full.selfcheck.passed
    for name, value in full.selfcheck.stats.items():
        assert fast.selfcheck.stats[name] == pytest.approx(value, abs=1e-6), name

    calls.clear()
    lean = build_method(PINNED["escalating"][0]).plan(inp)
    assert not calls and _digest(lean) == _digest(full)


def test_a_failing_level_stops_at_its_first_failing_layer(monkeypatch) -> None:
    """The KL is a maximum over the checked layers: a level below the cap reads its checked
    layers one at a time, the last first, and stops at the first whose KL fails (the others
    are neither planned nor read); the request settles where reading every layer settles."""
    cfg = UniCacheConfig(keep_ratio=0.05, selfcheck_threshold=1e-6, escalate_max_keep=0.4,
                         escalate_factor=2.0, selfcheck_layers=3, selfcheck_content_threshold=1.0)
    inp = make_inputs(layers=4, tokens=120, seed=3)
    reads, planned = [], []
    real_stats, real_plan = selfcheck.layer_stats, Method._plan_layer
    monkeypatch.setattr(selfcheck, "layer_stats", lambda ctx, li, plans, kl_only=False: (
        reads.append((li, kl_only)) or real_stats(ctx, li, plans, kl_only)))
    monkeypatch.setattr(Method, "_plan_layer", lambda self, ctx, d, li, scores: (
        planned.append(li) or real_plan(self, ctx, d, li, scores)))
    early = build_method(cfg).plan(inp)
    assert early.escalations == 3 and early.fallback
    # 0.05, 0.1 and 0.2 fail on layer 3 alone; the cap (0.4) reads every checked layer
    assert reads == [(3, True)] * 3 + [(1, True), (2, True), (3, True)]
    assert planned[:6] == [3, 3] * 3  # each failed level planned layer 3 of both spans only

    monkeypatch.setattr(selfcheck.SelfCheck, "kl_check", lambda *a, **k: None)
    every = build_method(cfg).plan(inp)
    assert _digest(early) == _digest(every) and early.keep_ratio == every.keep_ratio
    assert early.selfcheck.stats == every.selfcheck.stats


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(37, 3, 16), (200, 2, 128), (5, 1, 7)])
def test_unit_kv_is_normalise_then_concatenate(dtype, shape) -> None:
    g = torch.Generator().manual_seed(1)
    k = (3 * torch.randn(*shape, generator=g)).to(dtype)
    v = torch.randn(*shape, generator=g).to(dtype)
    k[0] = 0  # a zero key: normalised to zeros, as F.normalize does
    x, norms = signals.unit_kv_norms(k, v)
    want = torch.cat([F.normalize(k.float(), dim=-1), F.normalize(v.float(), dim=-1)], -1) / 2**0.5
    assert torch.equal(x, want)
    assert torch.equal(norms[..., 0], k.float().norm(dim=-1))
    assert torch.equal(norms[..., 1], v.float().norm(dim=-1))


def test_raster_redundancy_matches_its_definition() -> None:
    """Each token's mean cosine (of unit K/V) to the neighbours up to 4 away inside its run,
    clipped to [0, 1]; layers stacked in front give each layer's numbers."""
    g = torch.Generator().manual_seed(2)
    x = torch.stack([signals.unit_kv(torch.randn(300, 2, 16, generator=g),
                                     torch.randn(300, 2, 16, generator=g)) for _ in range(2)])
    run = torch.zeros(300, dtype=torch.long)
    run[100:250] = 1
    got = signals.raster_redundancy(x, run, 4)
    assert got.shape == (2, 2, 300)
    for layer in range(2):
        for i in (0, 3, 99, 100, 101, 180, 249, 250, 299):
            near = [j for j in range(i - 4, i + 5)
                    if j != i and 0 <= j < 300 and run[j] == run[i]]
            cos = torch.stack([(x[layer, i] * x[layer, j]).sum(-1) for j in near]).mean(0)
            torch.testing.assert_close(got[layer, :, i], cos.clamp(0, 1), rtol=0, atol=1e-6)
        assert torch.equal(signals.raster_redundancy(x[layer], run, 4), got[layer])


def test_raster_redundancy_in_chunks_is_one_product_per_offset(monkeypatch) -> None:
    """The dot products taken ``RASTER_CHUNK`` tokens at a time give exactly the numbers of one
    product over every token."""
    g = torch.Generator().manual_seed(4)
    x = signals.unit_kv(torch.randn(3, 700, 2, 16, generator=g),
                        torch.randn(3, 700, 2, 16, generator=g))
    run = torch.zeros(700, dtype=torch.long)
    run[130:645] = 1
    chunked = signals.raster_redundancy(x, run, 4)
    monkeypatch.setattr(signals, "RASTER_CHUNK", 1 << 20)
    assert torch.equal(chunked, signals.raster_redundancy(x, run, 4))


def test_merge_gather_matches_its_definition() -> None:
    """Entries of one member are exact copies; an entry of several is the weighted mean of its
    members, rescaled to their weighted mean norm."""
    g = torch.Generator().manual_seed(3)
    n, h, d, k = 40, 2, 8, 9
    x = torch.randn(n, h, 2, d, generator=g).to(torch.bfloat16)
    kept = torch.stack([torch.randperm(n, generator=g)[:k].sort().values for _ in range(h)])
    assign = torch.randint(-1, k, (h, n), generator=g).int()
    assign[:, ::2] = -1
    assign.scatter_(1, kept, torch.arange(k, dtype=torch.int32).expand(h, k))
    weight = torch.rand(h, n, generator=g)
    out = merge_gather(x, kept, assign, weight)
    for head in range(h):
        for j in range(k):
            members = (assign[head] == j).nonzero().flatten()
            got = out[j, head]
            if members.numel() == 1:
                assert torch.equal(got, x[kept[head, j], head])
                continue
            src = x[members, head].float()  # [M, 2, D]
            w = weight[head, members].view(-1, 1, 1)
            mean = (src * w).sum(0)
            target = (src.norm(dim=-1) * w[..., 0]).sum(0)
            want = mean * (target / mean.norm(dim=-1)).unsqueeze(-1)
            torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_span_merged_in_one_call_is_merged_layer_by_layer(dtype) -> None:
    """``execute`` merges every layer of a span in one ``merge_gather`` call (the layers side by
    side as heads) where they keep the same count: each entry bit for bit what its own layer's
    ``execute_layer`` gives."""
    from sglang_unicache.policy.executor import execute, execute_layer, execute_stacked

    inp = make_inputs(layers=4, dtype=dtype)
    method = build_method(UniCacheConfig(keep_ratio=0.2, selfcheck=False, layer_fill="next"))
    for span_plan in method.plan(inp).spans:
        assert execute_stacked(span_plan, inp.keys, inp.values) is not None
        assert any(lp.num_merged for lp in span_plan.layers)  # the merge path, not copies
        got = execute(span_plan, inp.keys, inp.values)
        sl = slice(span_plan.span.start, span_plan.span.end)
        for li, lp in enumerate(span_plan.layers):
            k, v = execute_layer(lp, inp.keys[li][sl], inp.values[li][sl])
            assert torch.equal(got.keys[li], k) and torch.equal(got.values[li], v)
    # counts that differ between layers (AirCache's budgets, no fill) take the per-layer path
    uneven = build_method(UniCacheConfig(keep_ratio=0.2, selfcheck=False, budget="aircache",
                                         layer_fill="none")).plan(inp).spans[0]
    assert len({lp.num_kept for lp in uneven.layers}) > 1
    assert execute_stacked(uneven, inp.keys, inp.values) is None


def test_reference_attention_from_kept_logits_equals_the_chunked_passes() -> None:
    """The self-check's full and rest-of-request attention sliced from the context's logits
    equal the two chunked passes, also when some observation queries are left out; without
    the outputs, either path gives its normalisers and logits unchanged."""
    inp = make_inputs(layers=2, tokens=120, window=6)
    pos = torch.tensor([50, 53, 80, 110, 115, 119])  # 50: inside span (4, 54); 80: between
    inp = ScoreInputs(inp.keys, inp.values, inp.spans, obs_queries=inp.obs_queries,
                      obs_positions=pos)
    spans = tuple((s.start, s.end) for s in inp.spans)
    rows = (pos >= 107) | (pos < 4)
    rows |= (pos >= 53) & (pos < 60)
    q, p = inp.obs_queries[1][rows], pos[rows]
    kept_logits, chunked = PlanContext(inp), PlanContext(inp, stats_chunk=32)
    assert kept_logits.logits(1) is not None and chunked.logits(1) is None
    fast = reference_attention(kept_logits, 1, q, p, rows, spans)
    slow = reference_attention(chunked, 1, q, p, rows, spans)
    for a, b in zip(fast[:4], slow[:4], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(fast[4], slow[4], strict=True):
        assert torch.equal(torch.isinf(a), torch.isinf(b))
        torch.testing.assert_close(a[torch.isfinite(a)], b[torch.isfinite(b)], rtol=1e-5,
                                   atol=1e-5)
    # Without outputs (what the KL reads): the same normalisers and logits, bit for bit.
    for ctx, full in ((kept_logits, fast), (chunked, slow)):
        lean = reference_attention(ctx, 1, q, p, rows, spans, outputs=False)
        assert lean[0] is None and lean[2] is None
        assert torch.equal(lean[1], full[1]) and torch.equal(lean[3], full[3])
        assert all(torch.equal(a, b) for a, b in zip(lean[4], full[4], strict=True))


@pytest.mark.parametrize("nested", [True, False])
def test_key_coverage_reuses_a_nested_level(nested: bool) -> None:
    g = torch.Generator().manual_seed(4)
    h, n, d = 2, 60, 16
    unit = F.normalize(torch.randn(h, n, d, generator=g), dim=-1)
    order = torch.stack([torch.randperm(n, generator=g) for _ in range(h)])
    first = order[:, :6].sort(dim=1).values
    second = (order[:, :15] if nested else order[:, 30:45]).sort(dim=1).values
    seen: dict = {}
    for kept in (first, second):
        got = key_coverage(unit, kept, seen)
        want = 1.0 - torch.bmm(unit, unit.gather(1, kept.unsqueeze(-1).expand(-1, -1, d))
                               .transpose(1, 2)).amax(-1).mean(-1)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_a_level_passing_its_kl_check_is_not_checked_again(monkeypatch) -> None:
    """The level that settles below the cap computes its KL once: the full check takes the
    KL check's statistics (only what decides is computed; content_lost is off here)."""
    calls = []
    real = selfcheck.layer_stats
    monkeypatch.setattr(selfcheck, "layer_stats",
                        lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    inp = make_inputs(layers=4, tokens=120, dtype=torch.bfloat16, seed=3)
    plan = build_method(PINNED["shipped"][0]).plan(inp)
    assert plan.escalations == 0 and plan.selfcheck.passed
    assert sorted(calls) == [2, 3]  # the two checked layers, once
