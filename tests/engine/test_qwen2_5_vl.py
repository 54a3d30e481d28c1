"""Qwen2.5-VL (its windowed vision tower) served with ``--unicache`` on the CPU platform, from a
tiny random checkpoint built here: keep 1.0 answers as stock SGLang does; keep 0.1 compresses
each image, a later question is served from the cache without encoding the image again, a
two-image request compresses both, and an agent loop encodes and compresses each new screenshot
once."""

from __future__ import annotations

import pytest

from tests.conftest import assert_integrity
from tests.support.agent import assert_each_screenshot_encoded_and_compressed_once
from tests.support.client import answer, chat, flush_cache, internal_state
from tests.support.images import data_url, image_chat, solid_png
from tests.support.tiny_vlm import build_tiny_qwen2_5_vl

IMAGE_TOKENS = 64
KEPT = 6  # keep 0.1 of a 64-token image
CHATS = [((200, 30, 30), "what colour is it?"), ((30, 200, 30), "describe the picture"),
         ((30, 30, 200), "is there a square?")]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_qwen2_5_vl(tmp_path_factory.mktemp("models") / "tiny-qwen2.5-vl")


def answers(server) -> list[str]:
    return [answer(chat(server, image_chat(solid_png(colour), question, max_tokens=8)))
            for colour, question in CHATS]


def test_keep_one_answers_as_stock(serve):
    stock, identity = serve.all((), ("--unicache", "--unicache-keep-ratio", "1.0"))
    assert answers(identity) == answers(stock)


def test_keep_a_tenth_compresses_reuses_and_takes_two_images(serve, nocheck_config, tmp_path):
    server = serve("--unicache", "--unicache-keep-ratio", "0.1", "--unicache-config",
                   nocheck_config)
    flush_cache(server)
    png = solid_png((140, 30, 200))
    chat(server, image_chat(png, "what colour is it?", max_tokens=4))
    first = internal_state(server)["unicache"]
    assert first["images_compressed"] == 1 and first["compressed_slots_held"] == KEPT
    later = chat(server, image_chat(png, "where is the square?", max_tokens=4))
    assert later["usage"]["prompt_tokens_details"]["cached_tokens"] >= IMAGE_TOKENS
    second = internal_state(server)["unicache"]
    assert second["spans_recalled"] + second["spans_reused"] == 1
    assert second["images_prefilled"] == first["images_prefilled"]  # not encoded again
    body = image_chat(solid_png((10, 120, 10)), "compare them", max_tokens=4)
    body["messages"][0]["content"].insert(
        0, {"type": "image_url", "image_url": {"url": data_url(solid_png((250, 250, 0)))}})
    chat(server, body)
    third = internal_state(server)["unicache"]
    assert third["images_compressed"] - second["images_compressed"] == 2
    colours = [(60 * i, 240 - 60 * i, 90) for i in range(3)]
    assert_each_screenshot_encoded_and_compressed_once(server, [solid_png(c) for c in colours],
                                                       tmp_path)
    assert_integrity(server)
