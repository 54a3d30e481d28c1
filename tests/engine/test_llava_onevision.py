"""LLaVA-OneVision (``LlavaQwenForCausalLM``: SigLIP tower, two-layer projector, anyres with
``image_newline``, Qwen2 language model with 1-D RoPE) served with ``--unicache`` on the CPU
platform, from a tiny random checkpoint built here: keep 1.0 answers as stock SGLang does; keep
0.1 compresses each image, a later question is served from the cache without encoding the image
again, and a two-image request (``multi-images``: each image padded to a square) compresses both.

SGLang's LLaVA image processor leaves the items' ``offsets`` unset; the model's ``pad_input_ids``
records each image's run on the request's inputs (``image_offsets``, ``image_pad_len``), and the
plugin copies them to the items (``startup._offsets_from_padding``)."""

from __future__ import annotations

import pytest

from tests.conftest import assert_integrity
from tests.support.client import answer, chat, flush_cache, internal_state
from tests.support.images import data_url, image_chat, solid_png
from tests.support.tiny_llava_onevision import (
    IMAGE_TOKENS,
    PADDED_IMAGE_TOKENS,
    build_tiny_llava_onevision,
)

KEPT = 14  # keep 0.1 of a 136-token image (64 base tokens, 8 x 9 tile tokens with newlines)
PADDED_KEPT = 6  # keep 0.1 of a 64-token padded image
CHATS = [((200, 30, 30), "what colour is it?"), ((30, 200, 30), "describe the picture"),
         ((30, 30, 200), "is there a square?")]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # SGLang picks its chatml-llava template from "llava-onevision-qwen2" in the path.
    return build_tiny_llava_onevision(
        tmp_path_factory.mktemp("models") / "tiny-llava-onevision-qwen2")


def answers(server) -> list[str]:
    return [answer(chat(server, image_chat(solid_png(colour), question, max_tokens=8)))
            for colour, question in CHATS]


def unicache(server) -> dict:
    return internal_state(server)["unicache"]


def two_images(first: bytes, second: bytes, question: str, **params) -> dict:
    """One request with two images: SGLang's LLaVA processor reads all of them only when the
    parts say ``multi-images`` (otherwise it processes the first)."""
    body = image_chat(second, question, **params)
    content = body["messages"][0]["content"]
    content.insert(0, {"type": "image_url", "image_url": {"url": data_url(first)}})
    for part in content:
        if part["type"] == "image_url":
            part["modalities"] = "multi-images"
    return body


def test_keep_one_answers_as_stock(serve):
    stock, identity = serve.all((), ("--unicache", "--unicache-keep-ratio", "1.0"))
    assert answers(identity) == answers(stock)


def test_keep_a_tenth_compresses_reuses_and_takes_two_images(serve, nocheck_config):
    server = serve("--unicache", "--unicache-keep-ratio", "0.1", "--unicache-config",
                   nocheck_config)
    flush_cache(server)
    png = solid_png((140, 30, 200))
    before = unicache(server)
    out = chat(server, image_chat(png, "what colour is it?", max_tokens=4))
    assert out["usage"]["prompt_tokens_details"]["image_tokens"] == IMAGE_TOKENS
    first = unicache(server)
    assert first["images_compressed"] - before["images_compressed"] == 1
    assert first["slots_freed"] - before["slots_freed"] == IMAGE_TOKENS - KEPT
    assert first["images_prefilled"] - before["images_prefilled"] == 1
    later = chat(server, image_chat(png, "where is the square?", max_tokens=4))
    assert later["usage"]["prompt_tokens_details"]["cached_tokens"] >= IMAGE_TOKENS
    second = unicache(server)
    assert (second["spans_recalled"] + second["spans_reused"]
            - first["spans_recalled"] - first["spans_reused"]) == 1
    assert second["images_prefilled"] == first["images_prefilled"]  # not encoded again
    out = chat(server, two_images(solid_png((250, 250, 0)), solid_png((10, 120, 10)),
                                  "compare them", max_tokens=4))
    assert out["usage"]["prompt_tokens_details"]["image_tokens"] == 2 * PADDED_IMAGE_TOKENS
    third = unicache(server)
    assert third["images_compressed"] - second["images_compressed"] == 2
    assert third["images_prefilled"] - second["images_prefilled"] == 2
    assert third["slots_freed"] - second["slots_freed"] == 2 * (PADDED_IMAGE_TOKENS - PADDED_KEPT)
    assert third["errors"] == third["fallbacks"] == 0
    assert_integrity(server)


def test_a_new_image_after_a_reused_span_is_not_served_from_it(serve, tmp_path):
    """The model's forward places an image's features at ``image_offsets - prefix_len``, its
    offsets in the ids the user sent and the prefix in the compacted row's: a request that would
    reuse a compressed image and encode another after it is matched on its original ids instead
    (``reuse.encodes_past_reused_spans``). With the random method an image keeps the same
    entries whichever request compresses it, so its answer is the one a fresh server gives."""
    config = tmp_path / "device-only.yaml"
    config.write_text('selfcheck: false\nhost_copies: "off"\n')  # the device reuse path
    server = serve("--unicache", "--unicache-method", "random", "--unicache-keep-ratio", "0.25",
                   "--unicache-config", str(config))
    first, second, third = (solid_png(c) for c in [(250, 250, 0), (10, 120, 10), (120, 10, 160)])
    flush_cache(server)
    fresh = answer(chat(server, two_images(first, third, "compare them", max_tokens=10)))
    flush_cache(server)
    chat(server, two_images(first, second, "compare them", max_tokens=2))
    before = unicache(server)
    later = answer(chat(server, two_images(first, third, "compare them", max_tokens=10)))
    after = unicache(server)
    assert after["spans_reused"] == before["spans_reused"]
    assert after["images_compressed"] - before["images_compressed"] == 2
    assert later == fresh
    assert_integrity(server)
