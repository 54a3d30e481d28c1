"""Client side: keep each image on one of several ``--unicache`` servers behind ``sglang-router``.

Each server has its own radix tree, so an image's compressed span lives on the server that
compressed it. ``sglang-router``'s ``cache_aware`` policy matches the *text* of a chat request,
so two questions about one image can land on two servers, and each compresses the image. Its
``manual`` policy routes on the ``X-SMG-Routing-Key`` header instead: one key, one server (new
keys are placed by ``--assignment-mode``). ``routing_key`` derives that key from the first image
of the conversation and the tenant, so every question about an image goes where its span is,
and tenants that do not share a cache (``cache_salt``) do not share a key.

    from openai import OpenAI
    from sglang_unicache.client import routing_headers

    client = OpenAI(base_url="http://router:30000/v1", api_key="-")
    client.chat.completions.create(model="default", messages=messages,
                                   extra_headers=routing_headers(messages, tenant="acme"))

Recipe and its test: ``docs/scale-out.md``, ``tests/engine/test_router.py``. Imports nothing
from SGLang.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

ROUTING_HEADER = "X-SMG-Routing-Key"


def first_image(messages: Iterable[Mapping[str, Any]]) -> bytes | None:
    """The first image of an OpenAI chat conversation: a data URL's decoded bytes, or any other
    URL as text (the server fetches it; the same URL is the same image). None without images."""
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            if part.get("type") != "image_url":
                continue
            url = part["image_url"]["url"] if isinstance(part["image_url"], dict) \
                else part["image_url"]
            if url.startswith("data:") and "," in url:
                header, payload = url.split(",", 1)
                return base64.b64decode(payload) if header.endswith(";base64") \
                    else payload.encode()
            return url.encode()
    return None


def routing_key(messages: Iterable[Mapping[str, Any]], tenant: str = "") -> str | None:
    """sha256 of the conversation's first image and the tenant; None without an image (then
    the router places the request as it likes)."""
    image = first_image(messages)
    if image is None:
        return None
    digest = hashlib.sha256(image)
    digest.update(b"\0" + tenant.encode())
    return digest.hexdigest()


def routing_headers(messages: Iterable[Mapping[str, Any]], tenant: str = "") -> dict[str, str]:
    """``{"X-SMG-Routing-Key": key}`` for a conversation with an image, else ``{}``."""
    key = routing_key(messages, tenant)
    return {ROUTING_HEADER: key} if key is not None else {}
