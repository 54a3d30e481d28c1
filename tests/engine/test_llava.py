"""A 1-D RoPE VLM (LLaVA: Llama text model, Pixtral tower): compressed decoding and reuse give the
tokens of a transformers reference whose cache holds the same kept entries at their original
positions (the plugin shifts the positions of every later token by the entries removed)."""

from __future__ import annotations

import pytest

from sglang_unicache.policy.config import UniCacheConfig
from tests.engine.test_reference import kept_entries
from tests.support.client import answer, chat, internal_state
from tests.support.images import image_chat, solid_png
from tests.support.reference import (
    greedy_with_pruned_cache,
    image_span,
    load,
    prompt_inputs,
)

KEEP = 0.25
NEW_TOKENS = 10
WARM = "what colour is it?"  # the question that compresses an image before it is reused


@pytest.fixture(scope="module")
def llava_model(tmp_path_factory):
    from tests.support.tiny_llava import build_tiny_llava

    return build_tiny_llava(tmp_path_factory.mktemp("models") / "tiny-llava")


@pytest.fixture(scope="module")
def llava_server(llava_model, nocheck_config, server_factory):
    from tests.conftest import LOG_DIR
    from tests.support.server import start_server

    server_factory.make_room(1, hold=True)
    server = start_server(llava_model, [
        "--unicache", "--unicache-method", "random", "--unicache-keep-ratio", str(KEEP),
        "--unicache-config", nocheck_config, "--dtype", "float32", "--enable-cache-report"],
        LOG_DIR / "server-llava-random.log")
    yield server
    server.stop()
    server_factory.release(1)


def selection(model, inputs, span):
    text = model.config.text_config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    config = UniCacheConfig(method="random", keep_ratio=KEEP, selfcheck=False)
    return kept_entries(config, text.num_hidden_layers, inputs["input_ids"].shape[1],
                        text.num_key_value_heads, head_dim, span)


def test_llava_decodes_on_its_compressed_image_like_the_reference(llava_server, llava_model):
    model, processor = load(llava_model)
    differs_from_full = positions_matter = False
    for colour, question in [((200, 40, 40), "what colour is it?"),
                             ((20, 120, 220), "describe the picture"),
                             ((240, 240, 20), "where is the square?")]:
        png = solid_png(colour)
        inputs = prompt_inputs(processor, png, question)
        span = image_span(inputs, model.config.image_token_id)
        kept = selection(model, inputs, span)
        before = internal_state(llava_server)["unicache"]
        served = answer(chat(llava_server, image_chat(png, question, max_tokens=NEW_TOKENS)))
        after = internal_state(llava_server)["unicache"]
        # One span per image: the 8 rows of patches and the breaks between them.
        assert after["images_compressed"] == before["images_compressed"] + 1
        assert after["slots_freed"] - before["slots_freed"] == span[1] - span[0] - kept[0].shape[1]
        reference = greedy_with_pruned_cache(model, inputs, span, kept, NEW_TOKENS)
        full = greedy_with_pruned_cache(model, inputs, span, None, NEW_TOKENS)
        differs_from_full |= reference != full
        # Without the plugin's offset, decode would run at the compacted row's positions.
        unshifted = greedy_with_pruned_cache(model, inputs, span, kept, NEW_TOKENS,
                                             shift=-(span[1] - span[0] - kept[0].shape[1]))
        positions_matter |= unshifted != reference
        assert served == processor.tokenizer.decode(reference, skip_special_tokens=True), (
            colour, question)
    assert differs_from_full, "compression changed no output: the comparison proves nothing"
    assert positions_matter, "positions changed no output: the comparison proves nothing"


def test_llava_reuses_the_span_at_the_right_positions(llava_server, llava_model):
    model, processor = load(llava_model)
    positions_matter = False
    for colour, question in [((90, 10, 160), "where is the square?"),
                             ((10, 200, 90), "describe the picture"),
                             ((250, 250, 250), "is there a circle?")]:
        png = solid_png(colour)
        chat(llava_server, image_chat(png, WARM, max_tokens=2))
        reused_before = internal_state(llava_server)["unicache"]["spans_reused"]
        served = chat(llava_server, image_chat(png, question, max_tokens=NEW_TOKENS))
        assert internal_state(llava_server)["unicache"]["spans_reused"] == reused_before + 1
        inputs = prompt_inputs(processor, png, question)
        span = image_span(inputs, model.config.image_token_id)
        # The span was selected when the first request (WARM) compressed it.
        kept = selection(model, prompt_inputs(processor, png, WARM), span)
        removed = (span[1] - span[0]) - kept[0].shape[1]
        shared = served["usage"]["prompt_tokens_details"]["cached_tokens"]  # original units
        assert shared > span[1], "the request did not reuse the cached span"
        reference = greedy_with_pruned_cache(model, inputs, span, kept, NEW_TOKENS,
                                             prune_at=shared)
        unshifted = greedy_with_pruned_cache(model, inputs, span, kept, NEW_TOKENS,
                                             prune_at=shared, shift=-removed)
        assert answer(served) == processor.tokenizer.decode(reference, skip_special_tokens=True)
        positions_matter |= reference != unshifted
    assert positions_matter, "positions changed no output: the comparison proves nothing"
