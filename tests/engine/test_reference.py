"""Compressed decoding is right: the server's tokens equal an independent transformers reference
whose cache holds exactly the same kept entries at their original positions, both for a request
that compressed its own image and for a later request that reuses the cached compressed span."""

from __future__ import annotations

import pytest
import torch

from sglang_unicache.policy.config import UniCacheConfig
from sglang_unicache.policy.inputs import ImageSpan, ScoreInputs
from sglang_unicache.policy.registry import build_method
from tests.support.client import answer, chat
from tests.support.images import image_chat, solid_png
from tests.support.reference import (
    greedy_with_pruned_cache,
    image_span,
    load,
    prompt_inputs,
)

KEEP = 0.25
NEW_TOKENS = 10
CASES = [((200, 40, 40), "what colour is it?"), ((20, 120, 220), "describe the picture"),
         ((240, 240, 20), "where is the square?")]


def kept_entries(config: UniCacheConfig, layers: int, tokens: int, heads: int, head_dim: int,
                 span: tuple[int, int]) -> list[torch.Tensor]:
    """The random method's per-layer [H, K] selection (it depends only on seed, layer, shape)."""
    kv = torch.zeros(layers, tokens, heads, head_dim)
    plan = build_method(config.replace(layer_fill="next")).plan(
        ScoreInputs(kv, kv, [ImageSpan(*span)]))
    return [layer.kept for layer in plan.image_plans()[0].layers]


@pytest.fixture
def random_server(server_factory, nocheck_config):
    return server_factory("--unicache", "--unicache-method", "random", "--unicache-keep-ratio",
                          str(KEEP), "--unicache-config", nocheck_config, "--dtype", "float32",
                          "--enable-cache-report")


def test_server_tokens_equal_the_pruned_cache_reference(random_server, tiny_model):
    model, processor = load(tiny_model)
    text = model.config.text_config
    config = UniCacheConfig(method="random", keep_ratio=KEEP, selfcheck=False)
    differs_from_full = False
    for colour, question in CASES:
        png = solid_png(colour)
        inputs = prompt_inputs(processor, png, question)
        span = image_span(inputs, model.config.image_token_id)
        kept = kept_entries(config, text.num_hidden_layers, inputs["input_ids"].shape[1],
                            text.num_key_value_heads, text.hidden_size // text.num_attention_heads,
                            span)
        assert kept[0].shape[1] == round(KEEP * (span[1] - span[0]))
        reference = greedy_with_pruned_cache(model, inputs, span, kept, NEW_TOKENS)
        full = greedy_with_pruned_cache(model, inputs, span, None, NEW_TOKENS)
        differs_from_full |= reference != full
        served = answer(chat(random_server, image_chat(png, question, max_tokens=NEW_TOKENS)))
        assert served == processor.tokenizer.decode(reference, skip_special_tokens=True), (
            colour, question)
    assert differs_from_full, "compression changed no output: the comparison proves nothing"


def test_reused_span_tokens_equal_the_prune_then_prefill_reference(random_server, tiny_model):
    """Request 2 asks another question about request 1's image: its question is prefilled on the
    compressed span from the tree. The reference prefills the shared prefix in full (as request 1
    did), prunes the image to the same kept set, then prefills request 2's own tokens."""
    from tests.support.client import internal_state

    model, processor = load(tiny_model)
    text = model.config.text_config
    config = UniCacheConfig(method="random", keep_ratio=KEEP, selfcheck=False)
    png = solid_png((90, 10, 160))
    chat(random_server, image_chat(png, "what colour is it?", max_tokens=2))
    reused_before = internal_state(random_server)["unicache"]["spans_reused"]
    question = "where is the square?"
    served = chat(random_server, image_chat(png, question, max_tokens=NEW_TOKENS))
    assert internal_state(random_server)["unicache"]["spans_reused"] == reused_before + 1
    inputs = prompt_inputs(processor, png, question)
    span = image_span(inputs, model.config.image_token_id)
    warm = prompt_inputs(processor, png, "what colour is it?")  # selected when it compressed
    kept = kept_entries(config, text.num_hidden_layers, warm["input_ids"].shape[1],
                        text.num_key_value_heads, text.hidden_size // text.num_attention_heads,
                        span)
    # Tokens the server took from the tree, in original coordinates (usage counts the span as
    # its N image tokens).
    shared = served["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert shared > span[1], "the request did not reuse the cached span"
    reference = greedy_with_pruned_cache(model, inputs, span, kept, NEW_TOKENS, prune_at=shared)
    own = greedy_with_pruned_cache(model, inputs, span, kept, NEW_TOKENS)
    assert answer(served) == processor.tokenizer.decode(reference, skip_special_tokens=True)
    assert reference != own, "prefill on the pruned span changed nothing: the test proves nothing"
