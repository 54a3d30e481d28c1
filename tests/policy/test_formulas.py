"""Seed formulas on small hand-computed cases: schedules, budgets, skewness, complexity, caps."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_unicache.policy.budgets.aircache import aircache_factors, sample_skewness
from sglang_unicache.policy.budgets.base import apportion
from sglang_unicache.policy.budgets.modality import (
    cap_with_overflow,
    density_rates,
    pairwise_cosine,
)
from sglang_unicache.policy.budgets.pyramid import pyramid_factors
from sglang_unicache.policy.budgets.unicache import cosine_rates
from sglang_unicache.policy.checks.dynamic_rate import complexity, rate_from_complexity
from sglang_unicache.policy.config import UniCacheConfig
from sglang_unicache.policy.registry import build_method
from sglang_unicache.policy.scorers.alignment import protected_count
from sglang_unicache.policy.scorers.unicache import layer_weights

from .conftest import make_inputs


def test_cosine_schedule_matches_seed_thirds() -> None:
    torch.testing.assert_close(
        cosine_rates(3, 0.75, 0.45), torch.tensor([0.75, 0.60, 0.45], dtype=torch.float64)
    )
    r = cosine_rates(5, 0.75, 0.45)
    expected = [0.45 + 0.3 * (1 + math.cos(math.pi * i / 4)) / 2 for i in range(5)]
    torch.testing.assert_close(r, torch.tensor(expected, dtype=torch.float64))
    assert torch.all(r[1:] < r[:-1])


def test_unicache_budget_profile_and_level() -> None:
    inp = make_inputs(layers=3, spans=((0, 100),), tokens=110)
    cfg = UniCacheConfig(keep_ratio=0.4, anchor_fraction=0.0, budget="unicache")
    plan = build_method(cfg).plan(inp).spans[0]
    # keep fractions 0.25/0.40/0.55 scaled to mean 0.4 -> 25/40/55 of 100 tokens
    assert [lp.budget for lp in plan.layers] == [25, 40, 55]
    assert plan.physical_slots == 55


def test_unicache_default_budget_holds_the_asked_share_of_slots() -> None:
    """The default method keeps round(keep * N) in every layer: the slots a pool holds are the
    keep ratio asked for, not the curve's largest layer (``docs/policy.md``)."""
    inp = make_inputs(layers=3, spans=((0, 100),), tokens=110)
    plan = build_method(UniCacheConfig(keep_ratio=0.4, anchor_fraction=0.0)).plan(inp).spans[0]
    assert [lp.budget for lp in plan.layers] == [40, 40, 40]
    assert plan.physical_slots == 40


def test_pyramid_factors() -> None:
    f = pyramid_factors(4, 20.0)
    torch.testing.assert_close(f, torch.tensor([1.95, 1.95 - 1.9 / 3, 1.95 - 3.8 / 3, 0.05]))
    assert abs(float(f.mean()) - 1) < 1e-6


def test_sample_skewness_formula() -> None:
    x = torch.tensor([1.0, 2.0, 3.0, 10.0])
    n, mu = 4, 4.0
    sd = math.sqrt(sum((v - mu) ** 2 for v in x.tolist()) / (n - 1))
    expected = n / ((n - 1) * (n - 2)) * sum(((v - mu) / sd) ** 3 for v in x.tolist())
    assert float(sample_skewness(x)) == pytest.approx(expected)
    assert float(sample_skewness(torch.tensor([1.0, 2.0, 3.0]))) == pytest.approx(0.0)


def test_aircache_factors_hand_computed() -> None:
    f = aircache_factors(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.5, 0.0, 2.5]), 0.1)
    # strength' = [0, .5, 1], skew' = [.2, 0, 1] -> 1/2 (s_t' + s_k') + 0.1
    torch.testing.assert_close(f, torch.tensor([0.2, 0.35, 1.1]))


def test_apportion_is_exact_and_bounded() -> None:
    k = apportion(30, torch.tensor([0.2, 0.35, 1.1]), 1, 20)
    assert int(k.sum()) == 30 and int(k.max()) <= 20 and int(k.min()) >= 1
    assert k.tolist() == [4, 6, 20]  # 20 capped, the rest proportional 0.2:0.35
    assert apportion(3, torch.tensor([0.0, 0.0, 5.0]), 1, 10).tolist() == [1, 1, 1]
    assert apportion(10**6, torch.ones(3), 1, 7).tolist() == [7, 7, 7]


def test_density_rates_and_caps_with_overflow() -> None:
    r_v, r_t = density_rates(0.7, rho_v=0.2, rho_t=0.8, n_v=800, n_t=200)
    k = 1000 / (800 * 0.8 + 200 * 0.2)
    assert (r_v, r_t) == pytest.approx((0.7 * 0.8 * k, 0.7 * 0.2 * k))
    assert (800 * r_v + 200 * r_t) / 1000 == pytest.approx(0.7)
    c_v, c_t = cap_with_overflow(r_v, r_t, 800, 200, 0.8, 0.4)
    assert c_v == 0.8 and c_t == pytest.approx(r_t + (r_v - 0.8) * 800 / 200)
    assert (800 * c_v + 200 * c_t) / 1000 == pytest.approx(0.7)
    # both capped: the rest cannot be placed
    assert cap_with_overflow(0.95, 0.5, 100, 100, 0.8, 0.4) == pytest.approx((0.8, 0.4))


def test_pairwise_cosine() -> None:
    same = torch.ones(5, 1, 4)
    assert pairwise_cosine(same).tolist() == pytest.approx([1.0])
    ortho = torch.eye(4).reshape(4, 1, 4)
    assert pairwise_cosine(ortho).tolist() == pytest.approx([0.0], abs=1e-6)


def test_complexity_mapping() -> None:
    c = complexity(1024, 64, 100, 2.0)
    assert c == pytest.approx(math.log(1024) + math.log(64) + 2.0 * 100 / 1088)
    assert rate_from_complexity(5.0, 0.4, 0.75, 8.0, 18.0) == 0.75
    assert rate_from_complexity(30.0, 0.4, 0.75, 8.0, 18.0) == 0.4
    assert rate_from_complexity(13.0, 0.4, 0.75, 8.0, 18.0) == pytest.approx(0.575)
    simple = rate_from_complexity(complexity(256, 16, 0), 0.4, 0.75, 8.0, 18.0)
    hard = rate_from_complexity(complexity(8192, 2048, 500), 0.4, 0.75, 8.0, 18.0)
    assert hard < simple  # more complex input -> more conservative


def test_dynamic_rate_sets_keep_ratio_from_original_input() -> None:
    inp = make_inputs()
    p = build_method(UniCacheConfig(dynamic_rate=True, selfcheck=False)).plan(inp)
    assert p.complexity is not None
    expected = 1 - rate_from_complexity(p.complexity, 0.4, 0.75, 8.0, 18.0)
    assert p.keep_ratio == pytest.approx(expected)
    n = inp.spans[0].length
    assert sum(lp.budget for lp in p.spans[0].layers) == 3 * max(1, round(expected * n))


def test_layer_dependent_weights() -> None:
    cfg = UniCacheConfig()
    assert layer_weights(cfg, 0, 9) == (0.4, 0.3, 0.3, 0.1)  # shallow: w_d 0.3
    assert layer_weights(cfg, 4, 9) == (0.4, 0.3, 0.2, 0.1)
    assert layer_weights(cfg, 8, 9) == (0.5, 0.3, 0.2, 0.1)  # deep: w_a 0.5
    off = cfg.replace(layer_dependent_weights=False)
    assert layer_weights(off, 0, 9) == (0.4, 0.3, 0.2, 0.1)


def test_alignment_discount_count() -> None:
    # rate 0.8, discount 0.5 -> aligned tokens compressed at 0.4 -> keep ceil(10 * 0.6) = 6
    assert protected_count(10, 20, 100, 0.5, max_share=1.0) == 6
    assert protected_count(10, 3, 100, 0.5, max_share=1.0) == 3  # never above the budget
    assert protected_count(10, 100, 100, 0.5, max_share=1.0) == 10
    # Half the budget at most by default: one entry is the score's, six give three.
    assert protected_count(10, 1, 64, 0.5, max_share=0.5) == 0
    assert protected_count(10, 6, 64, 0.5, max_share=0.5) == 3
    assert protected_count(2, 20, 100, 0.5, max_share=0.5) == 2


def test_aircache_layer_budgets_follow_strength_and_skewness() -> None:
    from sglang_unicache.policy.context import PlanContext
    from sglang_unicache.policy.scorers.aircache import elite_importance

    inp = make_inputs(layers=4)
    cfg = UniCacheConfig(method="aircache", keep_ratio=0.2, selfcheck=False)
    ctx = PlanContext(inp)
    alpha = cfg.aircache_alpha
    iv = torch.stack([elite_importance(ctx, li, alpha).mean(0)[ctx.is_visual] for li in range(4)])
    factors = aircache_factors(iv.sum(1).double(), sample_skewness(iv), cfg.aircache_floor)
    plan = build_method(cfg).plan(inp)
    for sp in plan.spans:
        n = sp.span.length
        want = apportion(4 * max(1, round(0.2 * n)), factors, 1, n)
        assert [lp.budget for lp in sp.layers] == want.tolist()
