"""Compressed image spans shared through the radix tree: reuse, multi-turn, tenancy."""

from __future__ import annotations

from tests.conftest import KEPT
from tests.support.client import available_slots, chat, flush_cache, internal_state
from tests.support.images import image_chat, solid_png

IMAGE_TOKENS = 64
TEXT_BEFORE_IMAGE = 4  # "<|im_start|>user\n<|vision_start|>"


def stats(server) -> dict:
    return internal_state(server)["unicache"]


def test_same_image_different_question_reuses_the_compressed_span(compressing):
    flush_cache(compressing)
    png = solid_png((201, 17, 99))
    chat(compressing, image_chat(png, "what colour is it?"))
    before, free_before = stats(compressing), available_slots(compressing)
    second = chat(compressing, image_chat(png, "where is the square?", max_tokens=4))
    after = stats(compressing)
    assert after["spans_reused"] == before["spans_reused"] + 1
    assert after["images_prefilled"] == before["images_prefilled"], "image encoded again"
    assert after["images_compressed"] == before["images_compressed"]
    usage = second["usage"]
    assert usage["prompt_tokens_details"]["image_tokens"] == IMAGE_TOKENS  # as sent, not K
    # Usage counts the image as the user sent it: N tokens cached, though the tree holds K.
    assert usage["prompt_tokens_details"]["cached_tokens"] >= TEXT_BEFORE_IMAGE + IMAGE_TOKENS
    assert usage["prompt_tokens_details"]["cached_tokens"] <= usage["prompt_tokens"]
    # Only the new question and answer took slots; the image's K entries were already there.
    new_slots = free_before - available_slots(compressing)
    assert new_slots <= usage["prompt_tokens"] - IMAGE_TOKENS + usage["completion_tokens"]


def test_three_turn_conversation_reuses_image_and_earlier_turns(compressing):
    flush_cache(compressing)
    png = solid_png((33, 144, 240))
    body = image_chat(png, "what colour is it?", max_tokens=6)
    messages = body["messages"]
    cached = []
    for question in ("is there a square?", "describe it"):
        out = chat(compressing, {**body, "messages": messages})
        cached.append(out["usage"]["prompt_tokens_details"]["cached_tokens"])
        messages = messages + [{"role": "assistant", "content": out["choices"][0]["message"]
                                ["content"]}, {"role": "user", "content": question}]
    out = chat(compressing, {**body, "messages": messages})
    cached.append(out["usage"]["prompt_tokens_details"]["cached_tokens"])
    turn1_prompt = TEXT_BEFORE_IMAGE + IMAGE_TOKENS + 1 + len("what colour is it?")  # ~ tokens
    assert cached[0] < TEXT_BEFORE_IMAGE + KEPT  # first turn: nothing of the image cached
    assert cached[1] >= TEXT_BEFORE_IMAGE + IMAGE_TOKENS + 1  # the image and its end marker
    assert cached[2] > cached[1], "turn 3 did not reuse turn 2's text"
    assert cached[1] <= turn1_prompt + 20


def test_a_span_is_never_served_across_cache_salts(compressing):
    flush_cache(compressing)
    png = solid_png((5, 5, 250))
    chat(compressing, image_chat(png, "what colour is it?", cache_salt="tenant-a"))
    before = stats(compressing)
    other = chat(compressing, image_chat(png, "what colour is it?", cache_salt="tenant-b"))
    after = stats(compressing)
    assert after["spans_reused"] == before["spans_reused"]
    assert after["images_compressed"] == before["images_compressed"] + 1
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] < TEXT_BEFORE_IMAGE + KEPT
    same = chat(compressing, image_chat(png, "describe it", cache_salt="tenant-a"))
    assert stats(compressing)["spans_reused"] == after["spans_reused"] + 1
    cached = same["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= TEXT_BEFORE_IMAGE + IMAGE_TOKENS


def test_reuse_churn_leaks_nothing(compressing):
    flush_cache(compressing)
    baseline = available_slots(compressing)
    for i in range(6):
        png = solid_png((40 * i, 255 - 40 * i, 90))
        for question in ("what colour is it?", "describe it"):
            chat(compressing, image_chat(png, question, max_tokens=4))
    flush_cache(compressing)
    assert available_slots(compressing) == baseline


def test_concurrent_requests_with_one_image_share_one_span(compressing):
    from tests.support.client import chat_all

    flush_cache(compressing)
    baseline = available_slots(compressing)
    png = solid_png((250, 120, 0))
    questions = ["what colour is it?", "describe it", "where is it?", "is it red?"]
    outs = chat_all(compressing, [image_chat(png, q, max_tokens=5) for q in questions])
    assert all(o["usage"]["completion_tokens"] == 5 for o in outs)
    flush_cache(compressing)
    assert available_slots(compressing) == baseline


def test_metrics_endpoint_counts_compression_and_reuse(server_factory, nocheck_config):
    import requests

    server = server_factory("--unicache", "--unicache-method", "knorm", "--unicache-keep-ratio",
                            "0.25", "--unicache-config", nocheck_config, "--enable-metrics")
    png = solid_png((3, 200, 100))
    chat(server, image_chat(png, "what colour is it?"))
    chat(server, image_chat(png, "describe it"))
    text = requests.get(f"{server.url}/metrics", timeout=30).text

    def value(name: str) -> float:
        lines = [ln for ln in text.splitlines() if ln.startswith(f"sglang_unicache_{name}_total")]
        assert lines, f"sglang_unicache_{name}_total missing from /metrics"
        return float(lines[0].split()[-1])

    assert value("images_compressed") >= 1
    assert value("views_unchecked") == 0  # the check is off: no view sat at a bounded ladder's top
    assert value("requests_parked") == 0  # overlap_compression is off by default
    assert value("slots_freed") >= IMAGE_TOKENS - KEPT
    assert value("spans_reused") >= 1
    assert value("fallbacks") == 0


def test_a_reused_image_skips_the_image_processor_too(compressing, stock):
    """``--unicache`` turns on SGLang's image preprocessing cache (256 MiB unless the user sets
    ``--mm-preprocess-cache-size-mb``): the second question about an image is served without
    running the image processor, besides skipping the encoder and the image's prefill."""
    png = solid_png((90, 200, 30))
    chat(compressing, image_chat(png, "what colour is it?"))
    before = internal_state(compressing)["mm_preprocess_cache"]
    chat(compressing, image_chat(png, "where is the square?"))
    after = internal_state(compressing)["mm_preprocess_cache"]
    assert after["enabled"]
    assert after["hits"] > before["hits"] and after["misses"] == before["misses"]
    assert not internal_state(stock)["mm_preprocess_cache"]["enabled"], "stock SGLang: off"

