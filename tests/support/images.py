"""Small deterministic test images and the request payloads that carry them."""

from __future__ import annotations

import base64
import io

from PIL import Image


def solid_png(color: tuple[int, int, int], size: int = 224) -> bytes:
    """A PNG of one colour with a light deterministic texture (so no two rows are identical)."""
    img = Image.new("RGB", (size, size), color)
    pixels = img.load()
    for y in range(0, size, 7):
        for x in range(0, size, 5):
            r, g, b = color
            pixels[x, y] = ((r + x) % 256, (g + y) % 256, (b + x + y) % 256)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def image_chat(png: bytes, question: str, **params) -> dict:
    """An OpenAI ``/v1/chat/completions`` body with one image and one question."""
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(png)}},
            {"type": "text", "text": question},
        ]}],
        "temperature": 0,
        "max_tokens": 8,
    }
    body.update(params)
    return body
