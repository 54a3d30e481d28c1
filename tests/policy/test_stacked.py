"""Several layers' signals at once (``policy/stacked.py``) give exactly the per-layer numbers,
and plans made with them are the plans made layer by layer."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sglang_unicache.policy import stacked
from sglang_unicache.policy.catalog import from_config
from sglang_unicache.policy.compressor import Method
from sglang_unicache.policy.config import UniCacheConfig
from sglang_unicache.policy.context import PlanContext
from sglang_unicache.policy.inputs import ImageSpan, ScoreInputs
from sglang_unicache.policy.ranks import ONE_RANK
from sglang_unicache.policy.registry import build_method
from tests.policy.conftest import make_inputs

SIGNALS = ("unit_kv", "key_norm", "redundancy", "received",
           "received_text", "visual_share")


def _one_layer_at_a_time(self, ctx, d, layers, scores) -> None:
    """``Method._plan_layers`` without the stacked layers: each layer alone (``reduce``)."""
    for li in layers:
        if li not in d.layers:
            d.layers[li] = self._plan_layer(ctx, d, li, scores)


def _contexts(cfg, inputs):
    return [from_config(PlanContext, cfg, inputs=inputs, shards=ONE_RANK) for _ in range(2)]


@pytest.mark.parametrize("group_bytes", [1, 1 << 30], ids=["one-layer-groups", "one-group"])
@pytest.mark.parametrize("query_weight", [1.0, 0.6])
def test_stacked_scores_and_signals_are_the_per_layer_ones(monkeypatch, group_bytes,
                                                            query_weight):
    monkeypatch.setattr(stacked, "GROUP_BYTES", group_bytes)
    cfg = UniCacheConfig(query_weight=query_weight)
    method = build_method(cfg)
    inputs = make_inputs(layers=5, tokens=130, spans=((4, 54), (60, 108), (110, 125)))
    per_layer, by_group = _contexts(cfg, inputs)
    groups = stacked.layer_groups(by_group)
    assert len(groups) == (5 if group_bytes == 1 else 1)
    expected = [method._layer_scores(per_layer, li) for li in range(5)]
    got = method._scores(by_group)
    for li in range(5):
        assert torch.equal(got[li], expected[li]), li
        for name in SIGNALS:
            assert torch.equal(by_group.cached(name, li, None), per_layer._cache[(name, li)]), name
    assert sorted(by_group._logits) == sorted(per_layer._logits) == [3, 4]
    for li in (3, 4):
        assert torch.equal(by_group._logits[li], per_layer._logits[li])


@pytest.mark.parametrize("config,escalations", [
    ({"selfcheck": False}, 0),
    ({"selfcheck_content_threshold": 1.0, "selfcheck_threshold": 0.02, "view_rungs": 1}, 3),
    ({"budget": "unicache", "keep_ratio": 0.2}, 2),  # layers keep different counts
])
def test_a_plan_from_stacked_layers_is_the_per_layer_plan(monkeypatch, config, escalations):
    """Signals of several layers at once and the layers of a span planned together (the
    merge's ``reduce_layers``) give the plan made layer by layer: kept entries, merges, weights,
    priorities, the level the self-check settles."""
    inputs = make_inputs(layers=6, tokens=140, spans=((4, 70), (72, 130)))
    method = build_method(UniCacheConfig(**{"keep_ratio": 0.1, **config}))
    stacked_plan = method.plan(inputs)
    monkeypatch.setattr("sglang_unicache.policy.compressor.layer_groups", lambda ctx: None)
    monkeypatch.setattr(Method, "_plan_layers", _one_layer_at_a_time)
    layer_plan = method.plan(inputs)
    assert stacked_plan.escalations == layer_plan.escalations == escalations
    assert stacked_plan.keep_ratio == layer_plan.keep_ratio
    merged = 0
    for a, b in zip(stacked_plan.spans, layer_plan.spans, strict=True):
        for la, lb in zip(a.layers, b.layers, strict=True):
            for name in ("kept", "assign", "weight", "priority"):
                assert torch.equal(getattr(la, name), getattr(lb, name)), name
            merged += int((la.assign >= 0).sum()) - la.kept.numel()
    assert merged > 0  # the merge's nearest-entry search ran


def test_the_per_layer_path_runs_where_stacking_does_not_apply():
    base = make_inputs(layers=3)
    cfg = UniCacheConfig()

    def groups(inputs, **changes):
        return stacked.layer_groups(
            from_config(PlanContext, dataclasses.replace(cfg, **changes), inputs=inputs,
                        shards=ONE_RANK))

    assert groups(base) == [range(0, 3)]
    assert groups(base, head_merge=True) is None
    assert groups(base, stats_chunk=64) is None  # 120 tokens: the logits are not kept whole
    no_queries = ScoreInputs(base.keys, base.values, base.spans)
    assert groups(no_queries) is None
    on_grid = ScoreInputs(base.keys, base.values, [ImageSpan(4, 54, grid=(5, 10))],
                          obs_queries=base.obs_queries)
    assert groups(on_grid) is None
