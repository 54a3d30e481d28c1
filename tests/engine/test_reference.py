"""Compressed decoding is right: the server's tokens equal an independent transformers reference
whose cache holds exactly the same kept entries at their original positions."""

from __future__ import annotations

import pytest
import torch

from sglang_unicache.config import UniCacheConfig
from sglang_unicache.registry import build_method
from sglang_unicache.testing.client import answer, chat
from sglang_unicache.testing.images import image_chat, solid_png
from sglang_unicache.testing.reference import (
    greedy_with_pruned_cache,
    image_span,
    load,
    prompt_inputs,
)
from sglang_unicache.types import ImageSpan, ScoreInputs

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


@pytest.fixture(scope="module")
def random_server(server_factory, tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "random.yaml"
    path.write_text("selfcheck: false\n")
    return server_factory("--unicache", "--unicache-method", "random", "--unicache-keep-ratio",
                          str(KEEP), "--unicache-config", str(path), "--dtype", "float32")


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
