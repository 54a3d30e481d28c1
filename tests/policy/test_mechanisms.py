"""Per-mechanism behaviour: elite window, merging, quantization, self-check, head merging,
redundancy, and what each baseline is supposed to keep."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_unicache.policy.compressor import Method, execute
from sglang_unicache.policy.config import UniCacheConfig
from sglang_unicache.policy.context import PlanContext
from sglang_unicache.policy.heads import apply_head_merge, plan_head_merge
from sglang_unicache.policy.inputs import ImageSpan, ScoreInputs
from sglang_unicache.policy.kernels.reference import merge_gather
from sglang_unicache.policy.quantize import dequantize, quantize, quantized_nbytes
from sglang_unicache.policy.reducers.merge import merge_weights
from sglang_unicache.policy.registry import BUDGETS, REDUCERS, build_method
from sglang_unicache.policy.scorers.aircache import elite_importance, elite_window
from sglang_unicache.policy.signals import neighbour_redundancy

from .conftest import make_inputs


def _elite_inputs() -> ScoreInputs:
    """10 image tokens, text at 10..15, window = positions 12..15; the last text query's logits on
    text keys 10..15 are [5, 0, 3, 2.95, 0, 1] (scale 1, one head, D = 8)."""
    t, d = 16, 8
    k = torch.zeros(1, t, 1, d)
    k[0, :10, 0, 1] = torch.linspace(0.0, 2.0, 10)  # image keys on axis 1
    k[0, 10:, 0, 0] = torch.tensor([5.0, 0.0, 3.0, 2.95, 0.0, 1.0])
    q = torch.zeros(1, 4, 1, d)
    q[0, :, 0, 0] = 1.0
    q[0, :, 0, 1] = torch.tensor([1.0, 2.0, 0.5, 0.0])
    return ScoreInputs(k, k.clone(), [ImageSpan(0, 10)], obs_queries=q, scale=1.0)


def test_elite_window_selection() -> None:
    inp = _elite_inputs()
    ctx = PlanContext(inp)
    elite = elite_window(ctx, 0, 0.9)
    # candidates 12..15 have logits 3, 2.95, 0, 1: exp(-0.05) = 0.95 >= 0.9 -> {12, 13}
    assert ctx.obs_positions[elite[0]].tolist() == [12, 13]
    iv = elite_importance(ctx, 0, 0.9)[0]
    keys, q = inp.keys[0][:, 0], inp.obs_queries[0][:, 0]
    manual = torch.zeros(10)
    for w, visible in ((0, [12]), (1, [12, 13])):  # elite queries at 12, 13; causal
        cols = torch.tensor(list(range(10)) + visible)
        manual += torch.softmax(q[w] @ keys[cols].T, dim=0)[:10] / 2
    torch.testing.assert_close(iv[:10], manual)
    assert float(iv[10:].abs().sum()) == 0.0


def test_merge_weights_and_norm_restore() -> None:
    scores = torch.tensor([[1.0, 0.0, 0.5]])
    assign = torch.tensor([[0, 0, -1]], dtype=torch.int32)
    w = merge_weights(scores, assign, 1)
    torch.testing.assert_close(w, torch.tensor([[1.001 / 1.002, 0.001 / 1.002, 0.0]]))
    x = torch.tensor([[[3.0, 0.0]], [[0.0, 1.0]], [[9.0, 9.0]]])  # [N=3, H=1, D=2]
    weight = torch.tensor([[0.75, 0.25, 0.0]])
    out = merge_gather(x, torch.tensor([[0]]), assign, weight)[0, 0]
    mean = 0.75 * x[0, 0] + 0.25 * x[1, 0]
    target = 0.75 * 3.0 + 0.25 * 1.0
    torch.testing.assert_close(out, mean / mean.norm() * target)


def test_merge_reducer_folds_near_duplicates_only() -> None:
    inp = make_inputs(layers=1, tokens=60, spans=((0, 50),), kv_heads=1, group=1)
    k, v = inp.keys[0].clone(), inp.values[0].clone()
    k[20:30] = k[20]  # a run of duplicates: redundancy ~1
    v[20:30] = v[20]
    inp = ScoreInputs(k[None], v[None], inp.spans, obs_queries=inp.obs_queries)
    plan = build_method(UniCacheConfig(keep_ratio=0.2)).plan(inp).spans[0]
    lp = plan.layers[0]
    kept = set(lp.kept[0].tolist())
    merged = [i for i in range(50) if lp.assign[0, i] >= 0 and i not in kept]
    assert merged, "duplicates should be folded, not dropped"
    for i in merged:  # every folded token is similar to its entry
        j = int(lp.kept[0, lp.assign[0, i]])
        cos = torch.cosine_similarity(k[i, 0], k[j, 0], dim=0)
        assert float(cos) >= 0.5
    evict = build_method(UniCacheConfig(keep_ratio=0.2, reducer="evict")).plan(inp).spans[0]
    assert evict.layers[0].num_merged == 0


@pytest.mark.parametrize("bits", [8, 4])
def test_quantization_error_bound(bits: int) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 3, 5, generator=g) * torch.tensor([0.01, 1.0, 100.0]).view(1, 3, 1)
    qt = quantize(x, bits)
    back = dequantize(qt)
    qmax = 127 if bits == 8 else 7
    scale = x.abs().amax(dim=(0, 2)) / qmax
    err = (back - x).abs().amax(dim=(0, 2))
    assert torch.all(err <= scale / 2 * (1 + 1e-5))  # per head: small heads keep precision
    assert qt.nbytes == quantized_nbytes(7, 3, 5, bits)
    assert qt.nbytes == (3 * 35 if bits == 8 else 3 * 18) + 12


def _bad_scorer_method(cfg: UniCacheConfig) -> Method:
    """A composition whose scorer ranks the *least* attended tokens first."""

    class Worst:
        name, needs_queries, query_dependent = "worst", True, True

        def score(self, ctx, layer):
            return -ctx.received(layer)

    return Method("worst", cfg, Worst(), BUDGETS["uniform"](cfg), REDUCERS["evict"](cfg))


def test_selfcheck_trips_on_bad_plan() -> None:
    inp = make_inputs(group=1)
    q = torch.stack([inp.keys[li][[7, 7, 7, 63, 63, 63]] * 6.0 for li in range(3)])
    inp = ScoreInputs(inp.keys, inp.values, inp.spans, obs_queries=q)  # queries -> tokens 7, 63
    cfg = UniCacheConfig(keep_ratio=0.1, method="snapkv", selfcheck_statistic="kl",
                         selfcheck_threshold=0.1, escalate_max_keep=0.1)
    good = build_method(cfg).plan(inp)
    bad = _bad_scorer_method(cfg).plan(inp)
    assert bad.selfcheck.checked and not bad.selfcheck.passed and bad.fallback
    assert bad.selfcheck.kl > cfg.selfcheck_threshold > good.selfcheck.kl
    assert bad.selfcheck.failure().startswith(f"kl {bad.selfcheck.kl:.3f} > 0.100")
    assert (good.selfcheck.failure() == "") == good.selfcheck.passed
    assert bad.escalations == 0 and bad.keep_ratio == 0.1
    full = build_method(cfg.replace(method="full")).plan(inp)
    assert full.selfcheck.passed and not full.fallback


def test_selfcheck_kl_is_minus_log_kept_mass_for_eviction() -> None:
    inp = make_inputs(layers=1, group=1, window=1, spans=((0, 100),))
    cfg = UniCacheConfig(method="knorm", keep_ratio=0.3, selfcheck_layers=1)
    plan = build_method(cfg).plan(inp)
    q, k = inp.obs_queries[0][0], inp.keys[0]  # [H, D], [T, H, D]
    kl = 0.0
    for h in range(k.shape[1]):
        p = torch.softmax((k[:, h] @ q[h]) * inp.scale, dim=0)
        kept = plan.spans[0].layers[0].kept[h]
        kl -= math.log(float(p[kept].sum() + p[100:].sum()))
    assert plan.selfcheck.kl == pytest.approx(kl / k.shape[1], rel=1e-4)


def test_failed_selfcheck_escalates_the_budget_before_falling_back() -> None:
    inp = make_inputs(group=1)
    q = torch.stack([inp.keys[li][[7, 7, 7, 63, 63, 63]] * 6.0 for li in range(3)])
    inp = ScoreInputs(inp.keys, inp.values, inp.spans, obs_queries=q)
    cfg = UniCacheConfig(keep_ratio=0.05, selfcheck_statistic="kl", escalate_max_keep=0.4,
                         escalate_factor=2.0, selfcheck_content_threshold=1.0)  # the query half
    # the worst method keeps the least-attended tokens: the KL falls as the budget grows
    kl = {keep: _bad_scorer_method(cfg.replace(keep_ratio=keep, escalate_max_keep=keep))
          .plan(inp).selfcheck.kl for keep in (0.05, 0.1, 0.2, 0.4)}
    assert kl[0.05] > kl[0.1] > kl[0.2] > kl[0.4] > 0.1
    capped = _bad_scorer_method(cfg).plan(inp)
    assert capped.fallback and capped.escalations == 3 and capped.keep_ratio == 0.4
    assert capped.spans[0].physical_slots == round(0.4 * 50)
    assert capped.selfcheck.value == pytest.approx(kl[0.4])
    # a threshold between the KL at 0.1 and at 0.05: one doubling, then compressed at 0.1
    threshold = 0.5 * (kl[0.05] + kl[0.1])
    once = _bad_scorer_method(cfg.replace(selfcheck_threshold=threshold)).plan(inp)
    assert once.escalations == 1 and once.keep_ratio == pytest.approx(0.1)
    assert not once.fallback and once.spans[0].physical_slots == 5
    # the default factor, sqrt 2: the rung between 0.05 and 0.1 (4 entries) already passes
    rungs = _bad_scorer_method(cfg.replace(selfcheck_threshold=threshold,
                                           escalate_factor=2**0.5)).plan(inp)
    assert rungs.escalations == 1 and rungs.keep_ratio == pytest.approx(0.05 * 2**0.5)
    assert rungs.selfcheck.passed and rungs.spans[0].physical_slots == 4
    climbed = _bad_scorer_method(cfg.replace(escalate_factor=2**0.5)).plan(inp)
    assert climbed.fallback and climbed.escalations == 6 and climbed.keep_ratio == 0.4


def test_a_bounded_view_climbs_within_its_bound_and_never_falls_back(monkeypatch) -> None:
    from sglang_unicache.policy.checks import selfcheck

    inp = make_inputs(group=1)
    q = torch.stack([inp.keys[li][[7, 7, 7, 63, 63, 63]] * 6.0 for li in range(3)])
    inp = ScoreInputs(inp.keys, inp.values, inp.spans, obs_queries=q)
    cfg = UniCacheConfig(keep_ratio=0.05, selfcheck_statistic="kl", escalate_max_keep=0.4,
                         selfcheck_content_threshold=1.0)
    unbounded = _bad_scorer_method(cfg).plan(inp)
    assert unbounded.fallback and unbounded.keep_ratio == 0.4  # every level fails
    # bounded at 0.15: 0.05 -> 0.071 -> 0.1 -> 0.141, each failing, and 0.2 is not taken
    bounded = _bad_scorer_method(cfg.replace(view_max_keep=0.15)).plan(inp)
    assert not bounded.fallback and bounded.escalations == 3
    assert bounded.keep_ratio == pytest.approx(0.05 * 2**1.5)
    assert {p.physical_slots for p in bounded.image_plans()} == {round(0.05 * 2**1.5 * 50)}
    assert bounded.selfcheck.passed and not bounded.selfcheck.checked  # the top is not checked
    assert bounded.selfcheck.at_bound and not unbounded.selfcheck.at_bound
    # a view that starts at the top of its ladder computes no check at all
    def no_attention(*args, **kwargs):
        raise AssertionError("the check ran at the top of a bounded ladder")

    monkeypatch.setattr(selfcheck, "reference_attention", no_attention)
    top = _bad_scorer_method(cfg.replace(keep_ratio=0.1, view_rungs=1,
                                         view_max_keep=0.15)).plan(inp)
    assert not top.fallback and top.escalations == 0 and top.selfcheck.at_bound
    assert top.keep_ratio == pytest.approx(0.1 * 2**0.5)


def test_a_view_rung_plans_the_request_above_the_keep_ratio() -> None:
    inp = make_inputs()
    base = build_method(UniCacheConfig(keep_ratio=0.1, view_rungs=0, selfcheck=False)).plan(inp)
    view = build_method(UniCacheConfig(keep_ratio=0.1, view_rungs=1, selfcheck=False)).plan(inp)
    assert base.keep_ratio == 0.1 and view.keep_ratio == pytest.approx(0.1 * 2**0.5)
    assert view.escalations == 0
    assert [p.physical_slots for p in base.spans] == [round(0.1 * p.span.length)
                                                      for p in base.spans]
    assert [p.physical_slots for p in view.spans] == [round(0.1 * 2**0.5 * p.span.length)
                                                      for p in view.spans]


def test_an_escalation_reuses_what_does_not_depend_on_the_plan(monkeypatch) -> None:
    """Each re-plan at a doubled K recomputes only what K changes. The self-check's
    attention over the whole request (once per checked layer) and the merge's unit K/V
    are computed once per request, however many times the check escalates."""
    from sglang_unicache.policy import signals
    from sglang_unicache.policy.checks import selfcheck

    inp = make_inputs(group=1)
    q = torch.stack([inp.keys[li][[7, 7, 7, 63, 63, 63]] * 6.0 for li in range(3)])
    inp = ScoreInputs(inp.keys, inp.values, inp.spans, obs_queries=q)
    calls = {"attend": [], "unit": []}
    attend, unit = selfcheck.reference_attention, signals.normalize_kv_

    def counted(name, fn, layer_of):
        def wrapper(*args, **kwargs):
            calls[name].append(layer_of(args))
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(selfcheck, "reference_attention", counted("attend", attend,
                                                                  lambda a: a[1]))
    def layers_of(args) -> tuple[int, ...]:  # one layer's [K | V], or several stacked
        stack = args[0] if args[0].dim() == 4 else args[0].unsqueeze(0)
        d = inp.head_dim
        return tuple(li for li, k in enumerate(inp.keys) for x in stack
                     if torch.equal(x[..., :d], k.float()))

    monkeypatch.setattr(signals, "normalize_kv_", counted("unit", unit, layers_of))
    cfg = UniCacheConfig(keep_ratio=0.05, selfcheck_threshold=1e-6, escalate_max_keep=0.4,
                         escalate_factor=2.0, selfcheck_layers=2)
    plan = build_method(cfg).plan(inp)
    assert plan.escalations == 3 and plan.fallback
    assert any(lp.merges and (lp.assign >= 0).sum() > lp.kept.numel()
               for p in plan.spans for lp in p.layers)  # merges happened
    assert calls["attend"] == [1, 2]  # per checked layer, once
    assert sorted(sum(calls["unit"], ())) == [0, 1, 2]  # the unit K/V: once per layer


def test_selfcheck_statistics_are_zero_when_nothing_is_lost() -> None:
    inp = make_inputs()
    kept_all = build_method(UniCacheConfig(method="knorm", keep_ratio=1.0)).plan(inp)
    assert kept_all.selfcheck.checked and kept_all.selfcheck.passed
    assert max(abs(v) for v in kept_all.selfcheck.stats.values()) < 1e-5
    lossy = build_method(UniCacheConfig(method="knorm", keep_ratio=0.2, escalate_max_keep=0.2,
                                        selfcheck_all_statistics=True)).plan(inp).selfcheck
    assert set(lossy.stats) == {"kl", "kl_head", "image_mass_lost", "output_error",
                                "key_coverage", "content_lost"}
    assert all(lossy.stats[name] > 1e-3 for name in lossy.stats)
    assert lossy.stats["kl_head"] >= lossy.stats["kl"]


@pytest.mark.parametrize("content_threshold,computed", [
    (0.15, {"kl", "kl_head", "content_lost"}), (1.0, {"kl", "kl_head"})])
@pytest.mark.parametrize("keep", [0.05, 0.1, 0.3])
def test_the_check_computes_only_what_decides_and_decides_the_same(monkeypatch, content_threshold,
                                                                   computed, keep) -> None:
    """Without ``selfcheck_all_statistics`` a KL-decided check computes the KL statistics and,
    while its half is on, content_lost (no attention output: the KL reads normalisers and
    logits alone): the same verdict, value and level as the full record."""
    from sglang_unicache.policy.checks import selfcheck

    def never(*args, **kwargs):
        raise AssertionError("a KL-decided check computed an attention output")

    inp = make_inputs()
    cfg = UniCacheConfig(keep_ratio=keep, selfcheck_threshold=0.05,
                         selfcheck_content_threshold=content_threshold)
    with monkeypatch.context() as m:
        m.setattr(selfcheck, "attend_from_logits", never)
        m.setattr(selfcheck, "window_attend", never)
        lean = build_method(cfg).plan(inp)
    full = build_method(cfg.replace(selfcheck_all_statistics=True)).plan(inp)
    assert set(lean.selfcheck.stats) == computed
    assert (lean.keep_ratio, lean.escalations, lean.fallback, lean.selfcheck.value) == \
        (full.keep_ratio, full.escalations, full.fallback, full.selfcheck.value)
    assert all(lean.selfcheck.stats[k] == full.selfcheck.stats[k] for k in computed)
    assert [lp.kept.tolist() for p in lean.spans for lp in p.layers] == \
        [lp.kept.tolist() for p in full.spans for lp in p.layers]


def test_output_error_matches_a_direct_computation() -> None:
    inp = make_inputs(layers=1, group=1, window=1, spans=((0, 100),))
    cfg = UniCacheConfig(method="knorm", keep_ratio=0.3, selfcheck_layers=1,
                         selfcheck_all_statistics=True)
    plan = build_method(cfg).plan(inp)
    q, k, v = inp.obs_queries[0][0], inp.keys[0], inp.values[0]
    errors, lost = [], []
    for h in range(k.shape[1]):
        p = torch.softmax((k[:, h] @ q[h]) * inp.scale, dim=0)
        keep = torch.zeros(k.shape[0], dtype=torch.bool)
        keep[plan.spans[0].layers[0].kept[h]] = True
        keep[100:] = True
        pq = torch.where(keep, p, torch.zeros_like(p))
        pq = pq / pq.sum()
        o_p, o_q = p @ v[:, h], pq @ v[:, h]
        errors.append(float((o_q - o_p).norm() / o_p.norm()))
        lost.append(float(1 - p[:100][keep[:100]].sum() / p[:100].sum()))
    stats = plan.selfcheck.stats
    assert stats["output_error"] == pytest.approx(sum(errors) / len(errors), rel=1e-4)
    assert stats["image_mass_lost"] == pytest.approx(sum(lost) / len(lost), rel=1e-4)


def test_head_merging() -> None:
    g = torch.Generator().manual_seed(0)
    k = torch.randn(40, 3, 8, generator=g)
    k[:, 1] = k[:, 0] * 2.0 + 0.01 * torch.randn(40, 8, generator=g)  # head 1 ~ head 0
    v = k.clone()
    head_map, weight = plan_head_merge(k, v, 0.88)
    assert head_map.tolist() == [0, 0, 2]
    assert float(weight[0] + weight[1]) == pytest.approx(1.0) and float(weight[2]) == 1.0
    merged = apply_head_merge(k, head_map, weight)
    torch.testing.assert_close(merged[:, 0], merged[:, 1])
    assert torch.equal(merged[:, 2], k[:, 2])
    torch.testing.assert_close(merged[:, 0], weight[0] * k[:, 0] + weight[1] * k[:, 1])


def test_head_merge_plan_reports_savings_separately() -> None:
    inp = make_inputs(kv_heads=3, group=1)
    keys = torch.stack(inp.keys)
    keys[:, :, 1] = keys[:, :, 0]
    vals = torch.stack(inp.values)
    vals[:, :, 1] = vals[:, :, 0]
    inp = ScoreInputs(keys, vals, inp.spans, obs_queries=inp.obs_queries)
    plan = build_method(UniCacheConfig(head_merge=True)).plan(inp).spans[0]
    lp = plan.layers[0]
    assert lp.head_map.tolist() == [0, 0, 2]
    assert torch.equal(lp.kept[0], lp.kept[1])  # one selection per head cluster
    assert plan.bytes.head_merged == plan.bytes.nominal * 2 // 3  # 2 clusters of 3 heads
    out = execute(plan, inp.keys, inp.values)
    assert torch.equal(out.keys[0][:, 0], out.keys[0][:, 1])


def test_redundancy_window() -> None:
    x = torch.ones(6, 1, 4)
    run = torch.tensor([0, 0, 0, 1, 1, 1])
    d = neighbour_redundancy(x, x, run, 2)
    torch.testing.assert_close(d, torch.ones(1, 6))
    y = torch.eye(4).reshape(4, 1, 4)
    d = neighbour_redundancy(y, y, torch.zeros(4, dtype=torch.long), 1)
    torch.testing.assert_close(d, torch.zeros(1, 4))


def _kept(method: str, inp: ScoreInputs, **kw) -> list[set[int]]:
    plan = build_method(UniCacheConfig(method=method, selfcheck=False, **kw)).plan(inp)
    return [set(p.layers[-1].kept[0].tolist()) for p in plan.spans]


def test_snapkv_and_aircache_keep_the_attended_token() -> None:
    inp = make_inputs()
    for method in ("snapkv", "pyramidkv", "aircache", "unicache"):
        kept = _kept(method, inp, keep_ratio=0.1)
        assert 3 in kept[0] and 3 in kept[1], method  # planted token a+3 of each span


def test_knorm_keeps_lowest_norm_and_h2o_keeps_recent() -> None:
    inp = make_inputs(layers=1)
    norms = inp.keys[0][4:54, 0].float().norm(dim=-1)
    assert _kept("knorm", inp, keep_ratio=0.1)[0] == set(torch.argsort(norms)[:5].tolist())
    h2o = _kept("h2o", inp, keep_ratio=0.2)[0]  # K = 10, half recent: the last 5 of the span
    assert {45, 46, 47, 48, 49} <= h2o


def test_alignment_protection_takes_at_most_its_share_of_the_budget() -> None:
    """Seed §5.3 with our cap: every span token an alignment token, keep 0.1 (K = 5 of 50)."""
    from sglang_unicache.policy.catalog import from_config
    from sglang_unicache.policy.ranks import ONE_RANK

    inp = make_inputs()
    forced = {}
    for share in (0.5, 1.0):
        m = build_method(UniCacheConfig(keep_ratio=0.1, selfcheck=False, alignment_max_share=share))
        ctx = from_config(PlanContext, m.config, inputs=inp, shards=ONE_RANK)
        draft = m._draft(ctx, inp.spans[0], 0.1, torch.ones(inp.num_tokens), identity=False)
        assert int(draft.budgets.min()) == 5
        forced[share] = int(draft.forced.sum())
    assert forced == {0.5: 2, 1.0: 5}  # half the budget left to the score; without the cap, none


def test_random_is_seeded() -> None:
    inp = make_inputs()
    assert _kept("random", inp, keep_ratio=0.1) == _kept("random", inp, keep_ratio=0.1)
    assert _kept("random", inp, keep_ratio=0.1) != _kept("random", inp, keep_ratio=0.1, seed=5)


def test_query_weight_zero_makes_selection_question_free() -> None:
    a = make_inputs(seed=0)
    b = ScoreInputs(a.keys, a.values, a.spans, obs_queries=make_inputs(seed=9).obs_queries)
    free = {"keep_ratio": 0.1, "query_weight": 0.0, "protect_alignment": False}
    assert _kept("unicache", a, **free) == _kept("unicache", b, **free)
    dep = {"keep_ratio": 0.1, "query_weight": 1.0}
    assert _kept("unicache", a, **dep) != _kept("unicache", b, **dep)


def test_layer_fill_next_uses_every_physical_slot() -> None:
    inp = make_inputs()
    plan = build_method(UniCacheConfig(layer_fill="next", budget="unicache")).plan(inp).spans[0]
    assert all(lp.num_kept == plan.physical_slots for lp in plan.layers)
    assert len({lp.budget for lp in plan.layers}) > 1
    assert plan.bytes.nominal == plan.bytes.physical


def test_compress_text_gives_text_segments_modality_budgets() -> None:
    inp = make_inputs()
    plan = build_method(UniCacheConfig(compress_text=True, keep_ratio=0.5)).plan(inp)
    text = [p for p in plan.spans if p.span.modality == "text"]
    assert text and len(plan.image_plans()) == 2
    for p in text:  # text rate capped at 0.4 -> keep >= 60% of each text run
        assert sum(lp.num_kept for lp in p.layers) >= 0.6 * p.span.length * 3 - 3


def test_short_spans_are_skipped_and_methods_declare_capabilities() -> None:
    inp = make_inputs(spans=((4, 10), (60, 108)))
    plan = build_method(UniCacheConfig()).plan(inp)
    assert plan.spans[0].skipped and plan.spans[0].layer_counts == [6, 6, 6]
    assert build_method("snapkv").needs_queries and not build_method("knorm").needs_queries
    assert not build_method("random").query_dependent and build_method("aircache").query_dependent
    no_q = ScoreInputs(inp.keys, inp.values, inp.spans)
    with pytest.raises(ValueError, match="observation queries"):
        build_method("snapkv").plan(no_q)
    assert build_method("unicache").plan(no_q).spans[1].layer_counts  # question-free fallback


def test_grid_redundancy_uses_vertical_neighbours() -> None:
    from sglang_unicache.policy.signals import grid_redundancy

    # 2 x 3 grid, columns identical top to bottom, columns mutually orthogonal
    col = torch.eye(3).reshape(1, 3, 1, 3).expand(2, 3, 1, 3).reshape(6, 1, 3)
    d = grid_redundancy(col, col, cols=3, k=1)
    # each token: 1 vertical neighbour (cos 1) and 1-2 horizontal ones (cos 0)
    torch.testing.assert_close(d[0], torch.tensor([0.5, 1 / 3, 0.5, 0.5, 1 / 3, 0.5]))
    inp = make_inputs()
    spans = [ImageSpan(s.start, s.end, grid=(5, 10)) for s in inp.spans[:1]] + [inp.spans[1]]
    gridded = ScoreInputs(inp.keys, inp.values, spans, obs_queries=inp.obs_queries)
    ctx = PlanContext(gridded)
    sl = slice(spans[0].start, spans[0].end)
    want = grid_redundancy(inp.keys[0][sl], inp.values[0][sl], 10, 4)
    torch.testing.assert_close(ctx.redundancy(0)[:, sl], want)


def _content_inputs(objects: int) -> ScoreInputs:
    """One 64-token image (2 KV heads) on a near-constant background with ``objects`` tokens whose
    first-layer values stand out and whose keys are short (so knorm keeps objects first); the text
    queries at the end attend to the first object."""
    g = torch.Generator().manual_seed(3)
    layers, t, h, d = 2, 72, 2, 8
    k = 0.05 * torch.randn(layers, t, h, d, generator=g)
    k[:, :, :, 1] += 1.0
    v = 1.0 + 0.01 * torch.randn(layers, t, h, d, generator=g)  # a plain background colour
    marks = [4 + (60 * i) // objects for i in range(objects)]
    v[:, marks] += 3.0 * torch.randn(layers, objects, h, d, generator=g)
    k[:, marks, :, 1] = 0.0
    k[:, marks[0], :, 0] = 0.5
    q = torch.zeros(layers, 2, h, d)
    q[:, :, :, 0] = 4.0
    return ScoreInputs(k, v, [ImageSpan(4, 68)], obs_queries=q, scale=1.0)


def test_content_check_guards_what_later_questions_need() -> None:
    """The question-free half of the check. An image whose content sits on a few tokens
    loses little of it at keep 0.1 and passes; an image whose content is spread over every token
    loses most of it whatever the question attends to: the check escalates to the cap and keeps
    the full KV, though the query half (the KL of the question that compressed it) passes."""
    cfg = UniCacheConfig(method="knorm", keep_ratio=0.1, selfcheck_threshold=1e9,
                         escalate_max_keep=0.4, escalate_factor=2.0)
    sparse = build_method(cfg).plan(_content_inputs(objects=4))
    assert sparse.selfcheck.passed and not sparse.fallback and sparse.escalations == 0
    assert sparse.selfcheck.stats["content_lost"] < cfg.selfcheck_content_threshold
    dense = build_method(cfg).plan(_content_inputs(objects=60))
    assert dense.selfcheck.stats["content_lost"] > cfg.selfcheck_content_threshold
    assert dense.fallback and dense.escalations == 2 and dense.keep_ratio == 0.4
    assert dense.selfcheck.value <= cfg.selfcheck_threshold  # the query half alone would pass
    lost = dense.selfcheck.stats["content_lost"]
    assert dense.selfcheck.failure() == f"content_lost {lost:.3f} > 0.150"  # the log names it
    off = build_method(cfg.replace(selfcheck_content_threshold=1.0)).plan(_content_inputs(60))
    assert off.selfcheck.passed and not off.fallback


def test_content_check_decides_without_observation_queries() -> None:
    """A request whose queries were not captured is still checked on its content."""
    inp = _content_inputs(objects=60)
    no_q = ScoreInputs(inp.keys, inp.values, inp.spans, scale=1.0)
    cfg = UniCacheConfig(method="knorm", keep_ratio=0.1, escalate_max_keep=0.1)
    plan = build_method(cfg).plan(no_q)
    assert plan.selfcheck.checked and set(plan.selfcheck.stats) == {"content_lost"}
    assert not plan.selfcheck.passed and plan.fallback


@pytest.mark.parametrize("method,fill", [("unicache", "next"), ("unicache", "none"),
                                         ("knorm", "next"), ("snapkv", "none")])
def test_hopeless_levels_are_skipped_with_the_same_outcome(monkeypatch, method, fill) -> None:
    """A keep level whose best possible kept set already loses more content than the self-check
    allows is not planned (``Method._skip_hopeless``): the request ends with the plan, check,
    keep ratio and escalation count that planning every level gives, in fewer plans."""
    from sglang_unicache.policy.checks.selfcheck import SelfCheck

    def outcome(plan):
        kept = [[lp.kept.tolist() for lp in sp.layers] for sp in plan.spans]
        return plan.keep_ratio, plan.escalations, plan.fallback, plan.selfcheck.passed, kept

    planned = []
    plan_spans = Method._plan_spans

    def counted(self, ctx, scores, keep, *args):
        planned.append(keep)
        return plan_spans(self, ctx, scores, keep, *args)

    monkeypatch.setattr(Method, "_plan_spans", counted)
    skipped_any = False
    for seed in range(6):
        inp = make_inputs(seed=seed, protected=(10, 70))
        for threshold in (0.2, 0.4, 0.6):
            cfg = UniCacheConfig(method=method, keep_ratio=0.05, escalate_max_keep=0.4,
                                 layer_fill=fill, selfcheck_content_threshold=threshold)
            planned.clear()
            fast = build_method(cfg).plan(inp)
            fast_plans = len(planned)
            with monkeypatch.context() as m:
                m.setattr(SelfCheck, "content_hopeless", lambda *a: False)
                planned.clear()
                slow = build_method(cfg).plan(inp)
            assert outcome(fast) == outcome(slow)
            # key_coverage reuses the levels checked before it (``selfcheck.key_coverage``):
            # the same number up to float rounding
            assert fast.selfcheck.stats == pytest.approx(slow.selfcheck.stats, rel=1e-6)
            assert fast_plans <= len(planned)
            skipped_any |= fast_plans < len(planned)
    assert skipped_any, "no case had a hopeless level: the test shows nothing"


def test_content_floor_bounds_every_plan_of_its_size() -> None:
    """``content_floor`` is the least ``content_lost`` of a kept set of its size per head: no
    random set loses less, and each head's top-K by content loses exactly that."""
    from sglang_unicache.policy.checks.selfcheck import _content, content_floor, content_lost
    from sglang_unicache.policy.plans import CompressionPlan, LayerPlan

    inp = make_inputs(layers=1, spans=((0, 100),))
    ctx = PlanContext(inputs=inp)
    seg, h = inp.spans[0], inp.num_kv_heads
    g = torch.Generator().manual_seed(1)

    def lost(kept: torch.Tensor) -> float:
        k = kept.shape[1]
        lp = LayerPlan(kept, torch.full((h, 100), -1, dtype=torch.int32), torch.zeros(h, 100), k)
        plan = CompressionPlan(seg, "t", [lp], torch.zeros(0, dtype=torch.long), k, None)
        return float(content_lost(ctx, [plan]))

    content, _ = _content(ctx, seg.start, seg.end)
    for k in (1, 5, 30, 99):
        floor = float(content_floor(ctx, [(seg, k)]))
        assert 0 < floor < 1
        for _ in range(20):
            assert lost(torch.stack([torch.randperm(100, generator=g)[:k] for _ in range(h)])) \
                >= floor - 1e-6
        assert lost(content.topk(k, dim=1).indices) == pytest.approx(floor, abs=1e-6)


@pytest.mark.parametrize("head_merge", [False, True])
def test_the_keys_the_check_compresses_alone_are_the_executed_keys(head_merge) -> None:
    """The self-check's KL reads compressed keys made without the values (``execute_one``):
    they are the keys ``execute_layer`` gives, bit for bit, where it merges keys and values in
    one call (evicted and whole layers take ``execute_one`` in both)."""
    from sglang_unicache.policy.executor import execute_layer, execute_one

    inp = make_inputs()
    cfg = UniCacheConfig(keep_ratio=0.1, selfcheck=False, head_merge=head_merge,
                         head_merge_threshold=0.3)
    plan = build_method(cfg).plan(inp)
    merged = 0
    for sp in plan.spans:
        sl = slice(sp.span.start, sp.span.end)
        for li, lp in enumerate(sp.layers):
            k, _ = execute_layer(lp, inp.keys[li][sl], inp.values[li][sl])
            assert torch.equal(execute_one(lp, inp.keys[li][sl]), k)
            merged += int((lp.assign >= 0).sum()) - lp.kept.numel()
            assert (lp.head_map is not None) == head_merge
    assert merged > 0
