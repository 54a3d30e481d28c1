"""Two ``--unicache`` servers behind ``sglang-router`` (the ``scale`` extra): with the ``manual``
policy and ``sglang_unicache.client.routing_headers``, each image is compressed once, on one server,
every later question about it reuses the span there, and the images are spread over both servers."""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor

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
def cluster(tiny_model, nocheck_config, tmp_path_factory, server_factory):
    server_factory.make_room(2)  # the two workers
    logs = tmp_path_factory.mktemp("router")
    flags = ["--unicache", "--unicache-method", "knorm", "--unicache-keep-ratio", "0.25",
             "--unicache-config", nocheck_config, "--enable-cache-report"]
    workers = []
    try:
        with ThreadPoolExecutor(2) as pool:  # both starts at once: each is mostly imports
            starting = [pool.submit(start_server, tiny_model, flags, logs / f"worker{i}.log")
                        for i in range(2)]
        workers += [future.result() for future in starting if future.exception() is None]
        for future in starting:
            future.result()  # a failed start raises here; the finally stops the started one

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


def ask(router, colour, question: str, **params) -> requests.Response:
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(solid_png(colour))}},
        {"type": "text", "text": question}]}]
    return requests.post(f"{router.url}/v1/chat/completions", timeout=120,
                         stream=params.get("stream", False),
                         headers=routing_headers(messages), json={
                             "model": "default", "messages": messages, "max_tokens": 2,
                             "temperature": 0, **params})


def first_questions(router) -> None:
    """The first question about each image, two at a time: the first of a pair is still
    answering (its stream open, 200 tokens to go) when the second is routed.

    ``min_group`` places a new key on the worker with the fewest keys *in flight* and breaks
    ties at random, so one client asking in turn gets a random spread (all four on one worker
    one time in eight). With a key in flight on one worker, the next new key goes to the other.
    """
    for held, sent in zip(COLOURS[::2], COLOURS[1::2], strict=True):
        with ask(router, held, QUESTIONS[0], max_tokens=200, ignore_eos=True,
                 stream=True) as stream:
            assert stream.status_code == 200, stream.text
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith(b"data: {"))
            reply = ask(router, sent, QUESTIONS[0])
            assert reply.status_code == 200, reply.text
            assert any(line == b"data: [DONE]" for line in lines)


def test_each_image_is_compressed_once_on_one_server(cluster) -> None:
    router, workers = cluster
    first_questions(router)
    for question in QUESTIONS[1:]:
        for colour in COLOURS:
            reply = ask(router, colour, question)
            assert reply.status_code == 200, reply.text
            # a repeat: served from the span on its server
            assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= IMAGE_TOKENS
    stats = [unicache(w) for w in workers]
    assert sum(s["images_compressed"] for s in stats) == len(COLOURS)  # once each, in all
    assert sum(s["spans_reused"] for s in stats) == (len(QUESTIONS) - 1) * len(COLOURS)
    # each pair split across the two servers
    assert [s["images_compressed"] for s in stats] == [2, 2], "two images on each server"
    assert all(s["integrity"] == [] for s in stats)
