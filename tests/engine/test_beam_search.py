"""Beam search with an image (``sampling_params.beam_width``): served on full KV, like stock.

SGLang forks the beam members from the leader's prompt row inside ``run_batch``; compacting the
leader afterwards freed slots the members still pointed at (the scheduler died: "pool memory
leak detected"). A beam request is neither compressed nor rewritten to reuse a compressed span;
the other requests about the same image still are.
"""

from __future__ import annotations

import requests

from tests.conftest import assert_integrity
from tests.support.client import chat, flush_cache, internal_state
from tests.support.images import data_url, image_chat, solid_png

BEAMS = 3


def beam(server, text: str, png: bytes) -> list[str]:
    body = {"text": text, "image_data": data_url(png),
            "sampling_params": {"max_new_tokens": 6, "beam_width": BEAMS, "n": BEAMS}}
    response = requests.post(f"{server.url}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    out = response.json()
    return [o["text"] for o in out] if isinstance(out, list) else [out["text"]]


def test_beam_search_with_an_image_answers_as_stock(compressing, stock, prompt_of):
    png = solid_png((33, 144, 99))
    text = prompt_of("what colour is it?")
    for server in (compressing, stock):
        flush_cache(server)
    before = internal_state(compressing)["unicache"]
    assert beam(compressing, text, png) == beam(stock, text, png)
    assert internal_state(compressing)["unicache"]["images_compressed"] == \
        before["images_compressed"]
    assert_integrity(compressing)
    # The image compressed by an ordinary request, then asked about with beams: the beams are
    # prefilled from the image (not rewritten to the compressed span) and answer as stock.
    chat(compressing, image_chat(png, "what colour is it?"))
    assert internal_state(compressing)["unicache"]["images_compressed"] == \
        before["images_compressed"] + 1
    assert beam(compressing, prompt_of("where is it?"), png) == \
        beam(stock, prompt_of("where is it?"), png)
    assert chat(compressing, image_chat(png, "and now?"))["choices"][0]["message"]["content"]
    assert_integrity(compressing)
