"""Two input checks: accumulated attention of the wrong shape is refused, not planned silently,
and SnapKV/PyramidKV keep their own observation window when an image sits at the end of the
prompt."""

from __future__ import annotations

import pytest
import torch

from sglang_unicache.policy.config import UniCacheConfig
from sglang_unicache.policy.inputs import ScoreInputs
from sglang_unicache.policy.registry import build_method
from tests.policy.conftest import make_inputs


@pytest.mark.parametrize("shape", [(4, 120), (2, 119)])  # [Hq, T] instead of [H, T]; one short
def test_accumulated_attention_of_the_wrong_shape_is_refused(shape):
    inp = make_inputs()
    with pytest.raises(ValueError, match=r"accumulated_attention must be \[H=2, T=120\]"):
        ScoreInputs(keys=list(inp.keys), values=list(inp.values), spans=inp.spans,
                    obs_queries=list(inp.obs_queries),
                    accumulated_attention=[torch.rand(shape) for _ in inp.keys])


def test_accumulated_attention_of_the_right_shape_plans():
    inp = make_inputs()
    with_acc = ScoreInputs(keys=list(inp.keys), values=list(inp.values), spans=inp.spans,
                           obs_queries=list(inp.obs_queries),
                           accumulated_attention=[torch.rand(2, 120) for _ in inp.keys])
    plan = build_method(UniCacheConfig(method="h2o", keep_ratio=0.2, selfcheck=False)).plan(
        with_acc)
    assert all(p.layers[0].kept.shape[0] == 2 for p in plan.spans)


@pytest.mark.parametrize("method", ["snapkv", "pyramidkv"])
def test_snapkv_keeps_its_observation_window_inside_an_image(method):
    """The image covers the last W = 6 prompt positions (the observation window): every head
    keeps all six, as SnapKV (and kvpress) always keep the window."""
    inp = make_inputs(spans=((60, 120),))
    assert inp.obs_positions.tolist() == list(range(114, 120))
    plan = build_method(UniCacheConfig(method=method, keep_ratio=0.2, selfcheck=False)).plan(inp)
    window = set(range(114 - 60, 120 - 60))
    for layer in plan.spans[0].layers:
        for head in layer.kept:
            assert window <= set(head.tolist())
