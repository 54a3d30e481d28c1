"""Peer check against kvpress 0.5.5 (NVIDIA/kvpress) on identical tensors: our key-norm,
StreamingLLM, un-pooled SnapKV and H2O (given kvpress's normalised attention sum) keep exactly the
tokens kvpress keeps, per KV head, at the same K; our PyramidKV gives every layer the budget of the
original PyramidKV formula (which kvpress transcribes) within one token.

kvpress needs transformers < 5.3 by its metadata while SGLang 0.5.23 pins 5.x above it, so it is
installed without dependencies (``make setup`` does; its import works): the test is skipped where
it is missing. kvpress scores a whole prompt; here the image span is the part it ranks.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

kvpress = pytest.importorskip("kvpress")

from sglang_unicache.policy.config import UniCacheConfig  # noqa: E402
from sglang_unicache.policy.inputs import ImageSpan, ScoreInputs  # noqa: E402
from sglang_unicache.policy.registry import build_method  # noqa: E402

T, H, G, D, W, K = 96, 2, 3, 16, 8, 20


def tensors(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(T, H, D, generator=g, dtype=torch.float64)
    values = torch.randn(T, H, D, generator=g, dtype=torch.float64)
    queries = torch.randn(T, H * G, D, generator=g, dtype=torch.float64)
    return keys, values, queries


def attention(keys, queries) -> torch.Tensor:
    """``[1, Hq, T, T]`` causal softmax attention (what an eager HF forward returns)."""
    k = keys.repeat_interleave(G, dim=1)  # query head j reads KV head j // G
    logits = torch.einsum("qhd,khd->hqk", queries, k) * D**-0.5
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    return logits.masked_fill(~causal, float("-inf")).softmax(-1).unsqueeze(0)


def ours(method: str, keys, values, queries, span_end: int, acc=None,
         **config) -> list[set[int]]:
    cfg = UniCacheConfig(method=method, keep_ratio=K / span_end, selfcheck=False, **config)
    inputs = ScoreInputs(keys=[keys], values=[values], spans=[ImageSpan(0, span_end)],
                         obs_queries=[queries[-W:]], accumulated_attention=acc)
    kept = build_method(cfg).plan(inputs).spans[0].layers[0].kept
    assert kept.shape == (H, K)
    return [set(kept[h].tolist()) for h in range(H)]


def top(scores: torch.Tensor, span_end: int) -> list[set[int]]:
    return [set(scores[0, h, :span_end].topk(K).indices.tolist()) for h in range(H)]


MODULE = SimpleNamespace(config=SimpleNamespace(num_attention_heads=H * G), head_dim=D)


def test_knorm_keeps_what_kvpress_keeps():
    keys, values, queries = tensors()
    theirs = kvpress.KnormPress().score(MODULE, torch.zeros(1, T, 1), keys.transpose(0, 1)[None],
                                        values.transpose(0, 1)[None], None, {})
    assert ours("knorm", keys, values, queries, T) == top(theirs, T)


def test_streaming_llm_keeps_what_kvpress_keeps():
    """Added in one file (``scorers/streaming_llm.py``): the sinks and the latest tokens."""
    keys, values, queries = tensors(3)
    press = kvpress.StreamingLLMPress(compression_ratio=1 - K / T)
    theirs = press.score(MODULE, torch.zeros(1, T, 1), keys.transpose(0, 1)[None],
                         values.transpose(0, 1)[None], None, {})
    expected = top(theirs + torch.arange(T) * 1e-6, T)  # kvpress's ties fall to the latest
    assert expected[0] == set(range(4)) | set(range(T - K + 4, T))
    assert ours("streaming_llm", keys, values, queries, T) == expected


def test_unpooled_snapkv_keeps_what_kvpress_keeps():
    """kvpress averages the window's attention and pools with kernel 5 by default; the SnapKV
    authors' LongBench setting (and our default) max-pools with 7. Un-pooled, the two agree."""
    keys, values, queries = tensors(1)
    press = kvpress.SnapKVPress(window_size=W, kernel_size=1)
    theirs = press.score(MODULE, torch.zeros(1, T, 1), keys.transpose(0, 1)[None],
                         values.transpose(0, 1)[None], attention(keys, queries), {})
    assert ours("snapkv", keys, values, queries, T - W, pool_kernel=1) == top(theirs, T - W)


def test_h2o_on_kvpress_normalised_attention_keeps_what_kvpress_keeps():
    keys, values, queries = tensors(2)
    theirs = kvpress.ObservedAttentionPress().score(
        MODULE, torch.zeros(1, T, 1), keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
        attention(keys, queries), {})
    assert ours("h2o", keys, values, queries, T, h2o_recent_fraction=0.0,
                acc=[theirs[0].float()]) == top(theirs, T)


def pyramid_formula(num_layers: int, avg: float, beta: float = 20) -> list[float]:
    """PyramidKV's per-layer budgets as the original code computes them (Zefan-Cai/KVCache-Factory
    ``pyramidkv/pyramidkv_utils.py``, window left out): the last layer keeps ``avg / beta``, the
    first ``2 * avg`` minus that, and the layers between decrease in equal steps."""
    min_num = avg / beta
    max_num = 2 * avg - min_num
    steps = (max_num - min_num) / (num_layers - 1)
    return [max_num - layer * steps for layer in range(num_layers)]


@pytest.mark.parametrize("num_layers,avg", [(2, 40), (3, 20), (5, 37), (12, 64), (28, 25),
                                            (32, 100)])
def test_pyramidkv_layer_budgets_follow_the_published_formula(num_layers: int, avg: int):
    """What our pyramidkv plan assigns per layer is the formula's budget within one token (ours
    are integers summing to exactly num_layers * avg); kvpress's ``PyramidKVPress`` (window 0)
    rounds the same formula."""
    want = pyramid_formula(num_layers, avg)
    n = 3 * avg  # the span: long enough that no layer's budget is clipped to it
    g = torch.Generator().manual_seed(num_layers)
    keys = torch.randn(num_layers, n + W, H, D, generator=g)
    inputs = ScoreInputs(keys=keys, values=torch.randn(keys.shape, generator=g),
                         spans=[ImageSpan(0, n)],  # the observation window is the text after it
                         obs_queries=torch.randn(num_layers, W, H * G, D, generator=g))
    cfg = UniCacheConfig(method="pyramidkv", keep_ratio=avg / n, pyramid_beta=20, selfcheck=False)
    layers = build_method(cfg).plan(inputs).spans[0].layers
    got = [lp.budget for lp in layers]
    assert [lp.num_kept for lp in layers] == got
    assert sum(got) == num_layers * avg
    assert all(abs(k - w) < 1 for k, w in zip(got, want, strict=True)), (got, want)
    press = kvpress.PyramidKVPress(compression_ratio=1 - avg / n, window_size=0, beta=20)
    theirs = [press.get_layer_budget(SimpleNamespace(
        config=SimpleNamespace(num_hidden_layers=num_layers), layer_idx=i), n)
        for i in range(num_layers)]
    assert all(abs(k - w) <= 0.5 + 1e-6 for k, w in zip(theirs, want, strict=True))
