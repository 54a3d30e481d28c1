"""TOVA, added as one file (``scorers/tova.py``): every head keeps the same tokens, those the
last position attends to most."""

from __future__ import annotations

from sglang_unicache.policy.config import UniCacheConfig
from sglang_unicache.policy.registry import build_method
from tests.policy.conftest import make_inputs


def test_tova_keeps_the_same_tokens_in_every_head_and_the_attended_object():
    plan = build_method(UniCacheConfig(method="tova", keep_ratio=0.2, selfcheck=False)).plan(
        make_inputs())
    for span in plan.spans:
        for layer in span.layers:
            assert all(layer.kept[h].tolist() == layer.kept[0].tolist()
                       for h in range(layer.kept.shape[0]))
            assert 3 in layer.kept[0].tolist()  # the planted object the queries point at
