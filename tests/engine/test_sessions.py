"""SGLang sessions (``/open_session``, ``session_params``) with images.

A session builds the next turn from the previous turn's ids and multimodal inputs, which must
stay the ones the user sent: session turns are served on their full KV (neither compressed nor
rewritten), token-identical to stock SGLang, and the server stays consistent.
"""

from __future__ import annotations

import requests

from tests.support.client import flush_cache, internal_state
from tests.support.images import data_url, solid_png

NEXT_TURN = "<|im_end|>\n<|im_start|>user\nwhat shape is it?<|im_end|>\n<|im_start|>assistant\n"


def post(server, path: str, body: dict):
    response = requests.post(f"{server.url}{path}", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json() if path != "/close_session" else None


def conversation(server, first: str, png: bytes) -> list[str]:
    session = post(server, "/open_session", {"capacity_of_str_len": 8192})
    params = {"max_new_tokens": 4, "temperature": 0}
    one = post(server, "/generate", {"text": first, "image_data": data_url(png),
                                     "sampling_params": params,
                                     "session_params": {"id": session}})
    two = post(server, "/generate", {"text": NEXT_TURN, "sampling_params": params,
                                     "session_params": {"id": session,
                                                        "rid": one["meta_info"]["id"]}})
    post(server, "/close_session", {"session_id": session})
    return [one["text"], two["text"]]


def test_a_session_with_an_image_is_served_like_stock(compressing, stock, prompt_of):
    flush_cache(compressing)
    png = solid_png((30, 160, 90))
    first = prompt_of("what colour is it?")
    before = internal_state(compressing)["unicache"]["images_compressed"]
    ours = conversation(compressing, first, png)
    assert ours == conversation(stock, first, png)
    assert internal_state(compressing)["unicache"]["images_compressed"] == before
    # Outside a session, a new image is compressed as usual afterwards.
    post(compressing, "/generate", {"text": first, "image_data": data_url(solid_png((1, 2, 3))),
                                    "sampling_params": {"max_new_tokens": 2}})
    assert internal_state(compressing)["unicache"]["images_compressed"] == before + 1
