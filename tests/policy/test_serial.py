"""Every plan type survives ``to_dict`` -> JSON -> ``from_dict`` unchanged: tensors of several
dtypes and shapes (empty ones included), None fields, tuples, nested dataclasses and lists."""

from __future__ import annotations

import dataclasses
import io
import json

import pytest
import torch

from sglang_unicache.policy.config import UniCacheConfig
from sglang_unicache.policy.inputs import ImageSpan
from sglang_unicache.policy.plans import (
    ByteReport,
    CompressedKV,
    CompressionPlan,
    LayerPlan,
    RequestPlan,
    SelfCheckResult,
)
from sglang_unicache.policy.quantize import quantize
from sglang_unicache.policy.registry import build_method

from .conftest import make_inputs


def same(a, b) -> bool:
    """Deep equality that compares tensors by dtype, shape and values (NaN equal to NaN)."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
        )
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(
            same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)
        )
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def layer(dtype: torch.dtype = torch.float32, heads: bool = True) -> LayerPlan:
    g = torch.Generator().manual_seed(0)
    return LayerPlan(
        kept=torch.tensor([[0, 2], [1, 3]]),
        assign=torch.tensor([[0, -1, 1, 1], [-1, 0, 0, 1]], dtype=torch.int32),
        weight=torch.rand(2, 4, generator=g).to(dtype),
        budget=2,
        head_map=torch.tensor([0, 0]) if heads else None,
        head_weight=torch.tensor([0.25, 0.75]) if heads else None,
        merges=False,
        priority=torch.tensor([[8.5, float("nan")], [float("inf"), -1.0]]),
    )


REPORT = ByteReport(
    full=4096,
    nominal=1024,
    physical=1536,
    quantized=0,
    head_merged=512,
    metadata=96,
    element_bytes=2,
)
CHECK = SelfCheckResult("kl", 0.25, 0.9, (1, 2), True, True, {"kl": 0.25, "kl_head": 0.5})


def span_plan(**kw) -> CompressionPlan:
    base = dict(
        span=ImageSpan(4, 8, grid=(2, 2)),
        method="unicache",
        layers=[layer(), layer(torch.bfloat16, heads=False)],
        protected=torch.zeros(0, dtype=torch.long),
        physical_slots=2,
        bytes=REPORT,
        quantization="int8",
        skipped=False,
        selfcheck=CHECK,
    )
    return CompressionPlan(**{**base, **kw})


def roundtrip(obj):
    back = type(obj).from_dict(json.loads(json.dumps(obj.to_dict())))
    assert same(back, obj), obj
    return back


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int8,
        torch.uint8,
        torch.int32,
        torch.int64,
        torch.bool,
    ],
)
def test_tensor_dtypes_and_shapes(dtype) -> None:
    x = (torch.arange(24).reshape(2, 3, 4) * 0.37).to(dtype)
    for t in (x, x[:, :0], x[0, 0, 0]):  # 3-d, empty, 0-d
        back = roundtrip(LayerPlan(t, t, t, 1))
        assert back.kept.dtype == dtype and back.kept.shape == t.shape


def test_every_plan_type_roundtrips() -> None:
    roundtrip(layer())
    roundtrip(layer(heads=False))
    roundtrip(REPORT)
    roundtrip(CHECK)
    roundtrip(SelfCheckResult("kl", 0.0, 0.9, (), False, True))  # empty tuple and dict
    roundtrip(span_plan())
    roundtrip(span_plan(span=ImageSpan(0, 3, "text"), selfcheck=None, layers=[]))
    roundtrip(
        RequestPlan(
            "unicache",
            [span_plan(), span_plan(skipped=True)],
            0.1,
            CHECK,
            12.5,
            torch.tensor([True, False, True]),
            2,
        )
    )
    roundtrip(RequestPlan("knorm", [], 0.5))  # None fields
    qt = quantize(torch.randn(3, 2, 5), 4)
    roundtrip(qt)
    assert isinstance(roundtrip(qt).shape, tuple)
    kv = [torch.randn(3, 2, 4, dtype=torch.bfloat16)]
    roundtrip(CompressedKV(kv, kv))
    roundtrip(CompressedKV(kv, kv, [qt], [quantize(torch.randn(3, 2, 5), 8)]))


def test_missing_keys_take_the_defaults() -> None:
    d = span_plan().to_dict()
    for key in ("quantization", "skipped", "selfcheck"):
        del d[key]
    back = CompressionPlan.from_dict(d)
    assert back.quantization == "off" and back.skipped is False and back.selfcheck is None


def test_a_real_plan_roundtrips_through_json_and_torch_save() -> None:
    plan = build_method(UniCacheConfig(keep_ratio=0.2, head_merge=True)).plan(make_inputs())
    back = roundtrip(plan)
    buf = io.BytesIO()
    torch.save(plan.to_dict(), buf)
    buf.seek(0)
    assert same(RequestPlan.from_dict(torch.load(buf, weights_only=True)), plan)
    assert isinstance(back.spans[0].span, ImageSpan)
    assert isinstance(back.selfcheck.layers, tuple)
