"""Bad images at the API get SGLang's normal error and leave the server healthy."""

from __future__ import annotations

import base64
import io

import pytest
import requests
from PIL import Image

from tests.support.images import image_chat, solid_png


def body_with_url(url: str) -> dict:
    return {"model": "default", "temperature": 0, "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                     {"type": "text", "text": "what colour?"}]}]}


def b64(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


def huge_png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (12000, 12000), (9, 9, 9)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("url", [
    "data:image/png;base64,!!!not-base64!!!",
    b64(b""),
    b64(b"GIF89a-but-truncated", "gif"),
    b64(b"%PDF-1.4 not an image", "pdf"),
], ids=["corrupt-base64", "zero-size", "truncated-gif", "not-an-image"])
def test_bad_image_is_a_clean_error_and_the_server_stays_healthy(compressing, url):
    response = requests.post(f"{compressing.url}/v1/chat/completions", json=body_with_url(url),
                             timeout=60)
    assert 400 <= response.status_code < 500, response.text[:300]
    assert requests.get(f"{compressing.url}/health", timeout=10).status_code == 200
    ok = requests.post(f"{compressing.url}/v1/chat/completions",
                       json=image_chat(solid_png((1, 1, 1)), "what colour?"), timeout=60)
    assert ok.status_code == 200


def test_enormous_image_is_resized_or_rejected_cleanly(compressing):
    response = requests.post(f"{compressing.url}/v1/chat/completions",
                             json=body_with_url(b64(huge_png())), timeout=120)
    assert response.status_code == 200 or 400 <= response.status_code < 500, response.text[:300]
    assert requests.get(f"{compressing.url}/health", timeout=10).status_code == 200
