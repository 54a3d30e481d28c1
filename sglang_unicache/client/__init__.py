"""Client side of a deployment: the routing key that keeps an image on one server behind
``sglang-router`` (``routing.py``). Imports nothing from SGLang or torch."""

from sglang_unicache.client.routing import ROUTING_HEADER, first_image, routing_headers, routing_key

__all__ = ["ROUTING_HEADER", "first_image", "routing_headers", "routing_key"]
