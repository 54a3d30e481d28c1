"""Two ``--unicache`` servers behind ``sglang-router`` (issue 15, the ``scale`` extra): with the
``manual`` policy and ``sglang_unicache.client.routing_headers``, each image is compressed once,
on one server, every later question about it reuses the span there, and the images are spread
over both servers."""

from __future__ import annotations

import sys
import time

import pytest
import requests

from sglang_unicache.client import routing_headers
from tests.support.images import data_url, solid_png
from tests.support.server import launch, start_server

pytest.importorskip("sglang_router", reason="sglang-router is the scale extra: pip install "
                                            "'sglang-unicache[scale]'")

IMAGE_TOKENS = 64
COLOURS = [(250, 10, 10), (10, 250, 10), (10, 10, 250), (250, 250, 10)]
QUESTIONS = ("what colour is it?", "describe the picture", "what shape is it?")


@pytest.fixture(scope="module")
def cluster(tiny_model, nocheck_config, tmp_path_factory):
    logs = tmp_path_factory.mktemp("router")
    flags = ["--unicache", "--unicache-method", "knorm", "--unicache-keep-ratio", "0.25",
             "--unicache-config", nocheck_config, "--enable-cache-report"]
    workers = []
    try:
        for i in range(2):
            workers.append(start_server(tiny_model, flags, logs / f"worker{i}.log"))

        def command(port: int) -> list[str]:
            return [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                    "--port", str(port), "--policy", "manual", "--assignment-mode", "min_group",
                    "--worker-urls", *(w.url for w in workers)]

        router = launch(command, logs / "router.log")
        wait_for_workers(router, len(workers))
        yield router, workers
        router.stop()
    finally:
        for worker in workers:
            worker.stop()


def wait_for_workers(router, count: int, timeout: float = 60) -> None:
    """The router answers /health before it has registered its workers (a request then gets
    503); /readiness counts the healthy ones."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready = requests.get(f"{router.url}/readiness", timeout=5)
        if ready.status_code == 200 and ready.json().get("healthy_workers") == count:
            return
        time.sleep(0.5)
    raise TimeoutError(f"the router did not register {count} workers in {timeout:.0f}s")


def unicache(worker) -> dict:
    return requests.get(f"{worker.url}/server_info", timeout=30).json()[
        "internal_states"][0]["unicache"]


def test_each_image_is_compressed_once_on_one_server(cluster) -> None:
    router, workers = cluster
    for question in QUESTIONS:
        for colour in COLOURS:
            messages = [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_url(solid_png(colour))}},
                {"type": "text", "text": question}]}]
            reply = requests.post(f"{router.url}/v1/chat/completions", timeout=120,
                                  headers=routing_headers(messages), json={
                                      "model": "default", "messages": messages,
                                      "max_tokens": 2, "temperature": 0})
            assert reply.status_code == 200, reply.text
            out = reply.json()
            if question != QUESTIONS[0]:  # a repeat: served from the span on its server
                assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= IMAGE_TOKENS
    stats = [unicache(w) for w in workers]
    assert sum(s["images_compressed"] for s in stats) == len(COLOURS)  # once each, in all
    assert sum(s["spans_reused"] for s in stats) == (len(QUESTIONS) - 1) * len(COLOURS)
    assert all(s["images_compressed"] >= 1 for s in stats), "images on both servers"
    assert all(s["integrity"] == [] for s in stats)
