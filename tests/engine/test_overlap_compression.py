"""``overlap_compression`` in the real engine: a compressing request sits out the batch after its
prefill and comes back compressed (``engine/parking.py``). Alone, it answers token for token as
the same server without it; beside requests already decoding, the trained model answers as it
does alone; nothing leaks, and the parked requests are counted."""

from __future__ import annotations

import concurrent.futures as futures
import json
import threading
from pathlib import Path

import pytest
import requests

from benchmarks.quality.eval_serving import (
    ask,
    checkpoint_grid,
    checkpoint_task,
    long_items,
    png_of,
    reuse_items,
)
from tests.conftest import KEEP, assert_integrity
from tests.engine.test_compression import PALETTE, workload
from tests.support.client import (
    answer,
    available_slots,
    chat,
    chat_all,
    flush_cache,
    internal_state,
)
from tests.support.images import data_url, image_chat, solid_png
from tests.support.server import start_server

CHECKPOINTS = Path(__file__).resolve().parents[2] / "assets" / "checkpoints"


def stream_long_answer(server, item, decoding: threading.Event) -> int:
    """A 64-token answer streamed; ``decoding`` is set at its first token. Returns the tokens."""
    body = {"model": "default", "temperature": 0, "max_tokens": 64, "ignore_eos": True,
            "stream": True, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_url(png_of(item.image))}},
                {"type": "text", "text": item.question}]}]}
    body["stream_options"] = {"include_usage": True}
    tokens = 0
    for chunk in stream_chunks(server, body):
        if any(c["delta"].get("content") for c in chunk.get("choices") or []):
            decoding.set()
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    return tokens


def stream_chunks(server, body):
    """The JSON chunks of a streamed chat completion, as they arrive."""
    with requests.post(f"{server.url}/v1/chat/completions", json=body, stream=True,
                       timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith(b"data: {"):
                yield json.loads(line[len(b"data: "):])


def parking_config(tmp_path: Path, *lines: str) -> str:
    path = tmp_path / "parking.yaml"
    path.write_text("\n".join(["overlap_compression: true", *lines]) + "\n")
    return str(path)


@pytest.fixture
def parking(server_factory, tmp_path_factory):
    """The ``compressing`` server's settings with ``overlap_compression`` on."""
    config = parking_config(tmp_path_factory.mktemp("cfg"), "selfcheck: false")
    server = server_factory("--unicache", "--unicache-method", "knorm", "--unicache-keep-ratio",
                            str(KEEP), "--unicache-config", config)
    yield server
    assert_integrity(server)


def test_a_parked_request_answers_as_without_parking(compressing, parking):
    """One request at a time (the same batches on both servers): each image request sits out
    the step after its prefill and rejoins an empty running batch."""
    before = internal_state(parking)["unicache"]
    for body in workload():
        flush_cache(compressing)
        flush_cache(parking)
        assert answer(chat(parking, body)) == answer(chat(compressing, body))
    after = internal_state(parking)["unicache"]
    assert after["images_compressed"] - before["images_compressed"] == 4
    assert after["requests_parked"] - before["requests_parked"] == 3  # the chats with images
    metrics = requests.get(f"{parking.url}/metrics", timeout=30).text
    exported = [ln for ln in metrics.splitlines()
                if ln.startswith("sglang_unicache_requests_parked_total")]
    assert exported and float(exported[0].split()[-1]) >= 3


def test_requests_arriving_while_others_decode_answer_as_alone(server_factory, tmp_path):
    """The bundled trained model as shipped, with ``overlap_compression``: a long answer decodes
    while first questions about new images arrive; each of them sits out one step beside it and
    rejoins the running batch. Every answer is the one the question gets alone, and every slot
    comes back."""
    server_factory.make_room(1)
    model = str(CHECKPOINTS / "tiny-vqa-qwen2-vl")
    grid, task = checkpoint_grid(model), checkpoint_task(model)
    questions = reuse_items(6, 1, 3, grid, task)
    long_item = long_items(1, 5, grid, task)[0]
    server = start_server(Path(model), ["--unicache", "--unicache-config",
                                        parking_config(tmp_path), "--enable-cache-report"],
                          tmp_path / "parking-trained.log")
    try:
        alone = []
        for item in questions:
            flush_cache(server)
            alone.append(ask(server, item, 8))
        flush_cache(server)
        baseline = available_slots(server)
        before = internal_state(server)["unicache"]["requests_parked"]
        with futures.ThreadPoolExecutor(max_workers=len(questions) + 1) as pool:
            decoding = threading.Event()
            first = pool.submit(stream_long_answer, server, long_item, decoding)
            assert decoding.wait(120)  # its first token is out: it decodes from here on
            together = list(pool.map(lambda item: ask(server, item, 8), questions))
            assert first.result() == 64
        state = internal_state(server)["unicache"]
        assert together == alone
        assert state["requests_parked"] - before == len(questions) + 1
        assert state["integrity"] == []
        flush_cache(server)
        assert available_slots(server) == baseline
    finally:
        server.stop()


def test_a_parked_prefill_followed_by_another_prefill_still_compresses(server_factory,
                                                                       tmp_path_factory):
    """Found by the streaming benchmark: the loop processes a parked prefill's result after the
    next batch ran; when that batch was another prefill (here: chunks of 48 tokens, so each
    64-token image spans two), it had started a new set of compression targets, and the parked
    requests' were lost (their images kept their full KV). Every image is compressed, and the
    integrity check (every parked request compressed when it left) holds."""
    config = parking_config(tmp_path_factory.mktemp("cfg"), "selfcheck: false")
    server = server_factory("--unicache", "--unicache-method", "knorm", "--unicache-keep-ratio",
                            str(KEEP), "--unicache-config", config, "--chunked-prefill-size",
                            "48")
    flush_cache(server)
    baseline = available_slots(server)
    before = internal_state(server)["unicache"]
    bodies = [image_chat(solid_png(c), "what colour is it?", max_tokens=4) for c in PALETTE[:4]]
    outs = chat_all(server, bodies, concurrency=len(bodies))
    after = internal_state(server)["unicache"]
    assert all(o["usage"]["completion_tokens"] == 4 for o in outs)
    assert after["images_compressed"] - before["images_compressed"] == len(bodies)
    assert after["requests_parked"] - before["requests_parked"] == len(bodies)
    assert after["integrity"] == []
    flush_cache(server)
    assert available_slots(server) == baseline


def test_an_abort_stops_a_request_that_sits_out_a_step(parking):
    """Each request is aborted by its id the moment its first token arrives, which is while it
    sits out the step after its prefill (its first token leaves before that step, it rejoins
    after it). The abort reaches it there: each answer ends at once with ``abort`` instead of
    decoding its 2,000 tokens, and every slot comes back."""
    flush_cache(parking)
    baseline = available_slots(parking)
    before = internal_state(parking)["unicache"]["requests_parked"]

    def abort_at_first_token(index: int) -> tuple[str, int]:
        rid = f"parked-abort-{index}"
        body = image_chat(solid_png(PALETTE[index]), "describe it", max_tokens=2000,
                          ignore_eos=True, stream=True, rid=rid,
                          stream_options={"include_usage": True})
        finish, tokens = None, 0
        for chunk in stream_chunks(parking, body):
            for choice in chunk.get("choices") or []:
                if choice["delta"].get("content") and tokens == 0:
                    tokens = 1
                    requests.post(f"{parking.url}/abort_request", json={"rid": rid},
                                  timeout=30).raise_for_status()
                finish = choice.get("finish_reason") or finish
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
        return finish, tokens

    with futures.ThreadPoolExecutor(4) as pool:
        ends = list(pool.map(abort_at_first_token, range(4)))
    assert internal_state(parking)["unicache"]["requests_parked"] - before == 4
    assert all(finish == "abort" and tokens < 100 for finish, tokens in ends), ends
    flush_cache(parking, timeout=60)
    assert available_slots(parking) == baseline
