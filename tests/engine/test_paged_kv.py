"""``--unicache`` with a paged KV cache (``--page-size`` 16 and 64; the ``torch_native`` backend
pages too): keep 1.0 answers as stock SGLang at the same page size; keep 0.1 holds whole pages
fewer, each image ending on a page boundary; a later question recalls the whole image from its
host copy (and a chat turn its history), or, once the copy is gone, reuses the compressed span,
without encoding the image again; a two-image request compresses both; nothing leaks
(``check_integrity`` counts pages).
"""

from __future__ import annotations

import pytest

from tests.conftest import assert_integrity
from tests.support.client import answer, available_slots, chat, flush_cache, internal_state
from tests.support.images import data_url, image_chat, solid_png
from tests.support.tiny_vlm import build_tiny_qwen2_vl

IMAGE_PX, IMAGE_TOKENS = 448, 256
KEPT = 26  # keep 0.1 of a 256-token image, before rounding up to the span's last page
CHATS = [((200, 30, 30), "what colour is it?"), ((30, 200, 30), "describe the picture"),
         ((30, 30, 200), "is there a square?")]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("models") / "tiny-qwen2-vl-448",
                               image_size=IMAGE_PX)


def ask(server, colour, question: str) -> dict:
    return chat(server, image_chat(solid_png(colour, IMAGE_PX), question, max_tokens=8))


def held_by(server, colour, question: str) -> tuple[str, int]:
    """The answer, and the slots the request's KV holds in the tree once it finished."""
    flush_cache(server)
    before = available_slots(server)
    out = ask(server, colour, question)
    return answer(out), before - available_slots(server)


EXACT_COPY_BYTES = 256 * 256  # a 256-token image of the tiny model: 256 bytes a token
ONE_COPY_GB = f"{1.5 * EXACT_COPY_BYTES / 2**30:.10f}"  # room for one exact copy, not two
A, B = (12, 34, 56), (200, 180, 20)


@pytest.mark.parametrize("page", [16, 64])
def test_paged_kv_identity_compression_recall_and_reuse(serve, nocheck_config, page):
    paged = ("--page-size", str(page))
    stock, identity = serve.all(paged, ("--unicache", "--unicache-keep-ratio", "1.0", *paged))
    expected = [answer(ask(stock, colour, question)) for colour, question in CHATS]
    _, stock_held = held_by(stock, A, "what colour is it?")
    later_question = image_chat(solid_png(A, IMAGE_PX), "where is the square?", max_tokens=1)
    stock_later = answer(chat(stock, later_question))
    stock.stop()
    assert stock_held % page == 0

    assert [answer(ask(identity, colour, question)) for colour, question in CHATS] == expected
    assert internal_state(identity)["unicache"]["images_compressed"] == 0
    assert_integrity(identity)
    identity.stop()

    server = serve("--unicache", "--unicache-keep-ratio", "0.1", "--unicache-config",
                   nocheck_config, "--unicache-host-copies", "exact",
                   "--unicache-host-copy-gb", ONE_COPY_GB, *paged)
    first_answer, held = held_by(server, A, "what colour is it?")
    first = internal_state(server)["unicache"]
    assert first["images_compressed"] == 1 and first["host_copies"] == 1
    kept = first["compressed_slots_held"]
    assert KEPT <= kept < KEPT + page  # rounded up to the end of the image's last page
    assert stock_held - held >= IMAGE_TOKENS - kept - page  # whole pages given back
    assert (stock_held - held) % page == 0 and held % page == 0
    assert_integrity(server)

    # A later question recalls the whole image from its host copy, from the image's first page
    # on: its first token is computed over every image token, as stock computes it.
    later = chat(server, later_question)
    assert answer(later) == stock_later
    assert later["usage"]["prompt_tokens_details"]["cached_tokens"] >= IMAGE_TOKENS
    second = internal_state(server)["unicache"]
    assert second["spans_recalled"] == 1
    assert second["images_prefilled"] == first["images_prefilled"]  # not encoded again
    assert_integrity(server)

    # The next turn of the first chat recalls the image and copies its history, to a page.
    body = image_chat(solid_png(A, IMAGE_PX), "what colour is it?", max_tokens=8)
    body["messages"] += [{"role": "assistant", "content": first_answer},
                         {"role": "user", "content": "is there a square?"}]
    chat(server, body)
    third = internal_state(server)["unicache"]
    assert third["spans_recalled"] == 2 and third["images_prefilled"] == first["images_prefilled"]
    assert_integrity(server)

    # Image B's copy takes the host budget: a question about A reuses its compressed span.
    ask(server, B, "what colour is it?")
    assert internal_state(server)["unicache"]["host_copies_evicted"] == 1
    ask(server, A, "is it large?")
    fourth = internal_state(server)["unicache"]
    assert fourth["spans_reused"] == 1 and fourth["spans_recalled"] == 2
    assert fourth["images_prefilled"] == third["images_prefilled"] + 1  # B's only
    assert_integrity(server)

    two = image_chat(solid_png((10, 120, 10), IMAGE_PX), "compare them", max_tokens=4)
    two["messages"][0]["content"].insert(0, {"type": "image_url", "image_url": {
        "url": data_url(solid_png((250, 250, 0), IMAGE_PX))}})
    chat(server, two)
    fifth = internal_state(server)["unicache"]
    assert fifth["images_compressed"] - fourth["images_compressed"] == 2
    assert_integrity(server)


def test_paged_pressure_recompresses_to_whole_pages_and_the_span_stays_reusable(
        serve, nocheck_config):
    """A small paged pool under a stream of distinct images: a cached span is re-compressed to
    a page boundary (whole pages freed) before it is evicted, and a later question reuses it."""
    page = 16
    server = serve("--unicache", "--unicache-method", "knorm", "--unicache-keep-ratio", "0.5",
                   "--unicache-config", nocheck_config, "--max-total-tokens", "1280",
                   "--page-size", str(page))
    flush_cache(server)
    ask(server, A, "what colour is it?")
    kept = internal_state(server)["unicache"]["compressed_slots_held"]
    assert 128 <= kept < 128 + page
    for i in range(20):
        ask(server, (10, 12 * i, 200), "what is it?")
        if internal_state(server)["unicache"]["spans_recompressed"]:
            break
    state = internal_state(server)["unicache"]
    assert state["spans_recompressed"] >= 1, "the pool filled up without any re-compression"
    assert state["recompress_slots_freed"] >= page and state["recompress_slots_freed"] % page == 0
    assert_integrity(server)
    ask(server, A, "describe it")
    after = internal_state(server)["unicache"]
    assert after["spans_reused"] == state["spans_reused"] + 1
    assert after["images_prefilled"] == state["images_prefilled"], "image encoded again"
    assert_integrity(server)


def test_paged_hicache_demotes_compressed_spans_and_loads_them_back(serve, nocheck_config):
    """``--enable-hierarchical-cache`` on a paged pool too small for the stream: compressed
    spans go to host memory and a later question loads its image's span back (not encoded or
    prefilled again)."""
    images = 12
    server = serve("--unicache", "--unicache-method", "knorm", "--unicache-keep-ratio", "0.25",
                   "--unicache-config", nocheck_config, "--max-total-tokens", "960",
                   "--enable-hierarchical-cache", "--hicache-size", "1", "--page-size", "16")
    colours = [(20 + 17 * i, 200 - 13 * i, (40 * i) % 256) for i in range(images)]
    for colour in colours:
        ask(server, colour, "what colour is it?")
    outs = [ask(server, colour, "what shape is it?") for colour in colours]
    state = internal_state(server)["unicache"]
    assert state["images_compressed"] == images and state["images_prefilled"] == images
    assert state["spans_reused"] == images, "a span was recomputed instead of loaded back"
    assert state["spans_loaded_back"] >= 1, state
    assert all(out["usage"]["prompt_tokens_details"]["cached_tokens"] >= IMAGE_TOKENS
               for out in outs)
    assert_integrity(server)
