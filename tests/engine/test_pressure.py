"""A small pool under a stream of distinct images: cached compressed spans are re-compressed
before they are evicted, stay reusable, and nothing leaks (real engine on CPU)."""

from __future__ import annotations

import re

import pytest
import requests

from tests.support.client import available_slots, chat, flush_cache, internal_state
from tests.support.images import image_chat, solid_png

POOL = 400  # ~5 uncompressed 64-token image prompts
IMAGE_TOKENS = 64
KEPT = 32  # keep ratio 0.5 of a 64-token image
TEXT_BEFORE_IMAGE = 4


@pytest.fixture
def small_pool(server_factory, nocheck_config):
    return server_factory("--unicache", "--unicache-method", "knorm", "--unicache-keep-ratio",
                          "0.5", "--unicache-config", nocheck_config, "--max-total-tokens",
                          str(POOL), "--enable-metrics", "--enable-cache-report")


def stats(server) -> dict:
    return internal_state(server)["unicache"]


def test_user_pool_size_wins_over_the_platform_cap(small_pool):
    info = requests.get(f"{small_pool.url}/server_info", timeout=10).json()
    assert info["max_total_num_tokens"] == POOL


def test_pressure_recompresses_the_oldest_span_which_stays_reusable(small_pool):
    flush_cache(small_pool)
    baseline = available_slots(small_pool)
    assert stats(small_pool)["radix_cache"] == "CompressedRadixCache"
    first = solid_png((250, 10, 10))
    chat(small_pool, image_chat(first, "what colour is it?", max_tokens=2))
    assert stats(small_pool)["compressed_slots_held"] == KEPT
    for i in range(20):
        chat(small_pool, image_chat(solid_png((10, 12 * i, 200)), "what is it?", max_tokens=2))
        if stats(small_pool)["spans_recompressed"]:
            break
    state = stats(small_pool)
    assert state["spans_recompressed"] >= 1, "the pool filled up without any re-compression"
    assert state["recompress_slots_freed"] >= KEPT // 2

    # The oldest span (the first image) was shrunk, not evicted: a new question reuses it.
    offset = len(small_pool.log())
    again = chat(small_pool, image_chat(first, "describe it", max_tokens=2))
    after = stats(small_pool)
    assert after["spans_reused"] == state["spans_reused"] + 1
    assert after["images_prefilled"] == state["images_prefilled"], "image encoded again"
    # The scheduler took fewer than KEPT entries from the tree (its log counts the compacted
    # row); usage counts the whole image as cached, as the user sent it.
    in_tree = [int(n) for n in re.findall(r"#cached-token: (\d+)", small_pool.log()[offset:])]
    assert TEXT_BEFORE_IMAGE + KEPT // 4 <= in_tree[0] < TEXT_BEFORE_IMAGE + KEPT
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= TEXT_BEFORE_IMAGE + IMAGE_TOKENS

    text = requests.get(f"{small_pool.url}/metrics", timeout=30).text
    assert any(line.startswith("sglang_unicache_spans_recompressed_total")
               and float(line.split()[-1]) >= 1 for line in text.splitlines())
    assert "sglang_unicache_compressed_slots_held" in text

    flush_cache(small_pool)
    assert available_slots(small_pool) == baseline
    assert stats(small_pool)["compressed_slots_held"] == 0
