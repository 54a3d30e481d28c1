"""``sglang_unicache.client``: the routing key follows the conversation's first image and the
tenant, whatever turn the conversation is at."""

from __future__ import annotations

from sglang_unicache.client import ROUTING_HEADER, routing_headers, routing_key
from tests.support.images import data_url, solid_png


def turn(image_url: str, question: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url}},
                                         {"type": "text", "text": question}]}]


def test_the_key_follows_the_first_image_and_the_tenant() -> None:
    red, blue = data_url(solid_png((250, 10, 10))), data_url(solid_png((10, 10, 250)))
    first = turn(red, "what colour is it?")
    later = [*first, {"role": "assistant", "content": "red"},
             {"role": "user", "content": "and its shape?"}]
    assert routing_key(first) == routing_key(later)  # the next turn goes where the span is
    assert routing_key(first) != routing_key(turn(blue, "what colour is it?"))
    assert routing_key(first, tenant="a") != routing_key(first, tenant="b")
    assert routing_key(turn("http://x/cat.png", "q")) == routing_key(turn("http://x/cat.png", "r"))
    assert routing_headers(first) == {ROUTING_HEADER: routing_key(first)}


def test_no_image_no_key() -> None:
    text = [{"role": "user", "content": "hello"}]
    assert routing_key(text) is None and routing_headers(text) == {}
