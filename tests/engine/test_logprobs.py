"""Prompt logprobs with compressed images: the scheduler must not die.

Prompt logprobs are computed in the prefill, before compaction, over the prompt the user sent; a
request that asks for them from a position at or before an image's end is served on full KV
(stock SGLang's answer), and the server stays up for the next request.
"""

from __future__ import annotations

import pytest
import requests

from tests.support.client import flush_cache, internal_state
from tests.support.images import data_url, solid_png


def generate(server, text: str, png: bytes, start: int | None = None, tokens: int = 3) -> dict:
    body = {"text": text, "image_data": data_url(png),
            "sampling_params": {"max_new_tokens": tokens, "temperature": 0}}
    if start is not None:
        body.update(return_logprob=True, logprob_start_len=start)
    response = requests.post(f"{server.url}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def prompt_logprobs(out: dict) -> list[float]:
    return [v for v, _, _ in out["meta_info"]["input_token_logprobs"] if v is not None]


@pytest.mark.parametrize("start", [0, 10, 75])
def test_prompt_logprobs_of_a_fresh_and_a_reused_image_match_stock(compressing, stock,
                                                                   prompt_of, start):
    flush_cache(compressing)
    png = solid_png((120, 7, start))
    warm = prompt_of("what colour is it?")
    generate(compressing, warm, png)  # compresses the image into the tree
    assert internal_state(compressing)["unicache"]["compressed_slots_held"] > 0
    for text in (warm, prompt_of("where is the square?")):  # same prompt, then another question
        ours, theirs = generate(compressing, text, png, start), generate(stock, text, png, start)
        got, want = prompt_logprobs(ours), prompt_logprobs(theirs)
        assert len(ours["meta_info"]["input_token_logprobs"]) == \
            len(theirs["meta_info"]["input_token_logprobs"])
        assert got == pytest.approx(want, abs=1e-3)
        assert ours["meta_info"]["prompt_tokens"] == theirs["meta_info"]["prompt_tokens"]
    generate(compressing, warm, png)  # the server is still up


def test_fresh_image_with_prompt_logprobs_is_not_compacted(compressing, prompt_of):
    flush_cache(compressing)
    before = internal_state(compressing)["unicache"]["images_compressed"]
    generate(compressing, prompt_of("is it red?"), solid_png((9, 9, 9)), start=0)
    assert internal_state(compressing)["unicache"]["images_compressed"] == before


def test_a_prompt_that_ends_in_a_reused_image(compressing, stock, prompt_of):
    """SGLang caps the match one token short of the prompt; a span past the cap is not rewritten."""
    flush_cache(compressing)
    png = solid_png((77, 1, 200))
    full = prompt_of("what colour is it?")
    cut = full[:full.index("<|vision_end|>")]  # the prompt ends in the image's tokens
    generate(compressing, full, png)
    out = generate(compressing, cut, png, tokens=2)
    assert out["meta_info"]["prompt_tokens"] == generate(stock, cut, png, tokens=2)[
        "meta_info"]["prompt_tokens"]
    generate(compressing, full, png)  # the server is still up
