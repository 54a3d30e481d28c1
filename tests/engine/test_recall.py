"""Host copies and recall: a later question about a compressed image is prefilled over the whole
image, loaded back from host memory (not encoded or prefilled again), then compresses its own
view; a chat's history is kept; copies are bounded, isolated by tenant, and leak nothing."""

from __future__ import annotations

import re
from concurrent import futures

import pytest
import requests

from tests.conftest import assert_integrity
from tests.support.client import (
    answer,
    available_slots,
    chat,
    chat_all,
    flush_cache,
    internal_state,
)
from tests.support.images import image_chat, solid_png

IMAGE_TOKENS = 64
TEXT_BEFORE_IMAGE = 4
KEEP = "0.1"
KEPT = 6  # entries of a 64-token image at keep 0.1 (at most 0.15 x its tokens)
INT8_COPY_BYTES = 9216  # a 64-token image of the tiny model, int8 rows with their scales
ONE_COPY_GB = f"{1.5 * INT8_COPY_BYTES / 2**30:.10f}"  # room for one int8 copy, not two


def recall_flags(nocheck_config: str, *extra: str) -> tuple[str, ...]:
    # The shipped method; the self-check off (on a random model it keeps most images whole).
    return ("--unicache", "--unicache-keep-ratio", KEEP, "--unicache-config", nocheck_config,
            *extra)


@pytest.fixture
def exact(server_factory, nocheck_config):
    """Recall from exact copies (the pool's dtype): a later question's prefill is stock's."""
    server_factory.prefetch(recall_flags(nocheck_config, "--unicache-host-copies", "int8",
                                         "--unicache-host-copy-gb", ONE_COPY_GB))
    server = server_factory(*recall_flags(nocheck_config, "--unicache-host-copies", "exact"))
    yield server
    assert_integrity(server)


@pytest.fixture
def one_copy(server_factory, nocheck_config):
    """int8 copies with room for one, and SGLang's retraction test switch."""
    server = server_factory(*recall_flags(nocheck_config, "--unicache-host-copies", "int8",
                                          "--unicache-host-copy-gb", ONE_COPY_GB),
                            env={"SGLANG_TEST_RETRACT": "1"})
    yield server
    assert_integrity(server)


def stats(server) -> dict:
    return internal_state(server)["unicache"]


def test_a_later_question_sees_the_whole_image_and_compresses_its_own_view(exact, stock):
    flush_cache(exact)
    assert "host copies on: up to" in exact.log()
    colours = [(201, 17, 99), (12, 230, 40), (90, 90, 250)]
    for colour in colours:
        png = solid_png(colour)
        chat(exact, image_chat(png, "what colour is it?", max_tokens=4))
        chat(stock, image_chat(png, "what colour is it?", max_tokens=4))
    before, free_before = stats(exact), available_slots(exact)
    assert before["host_copies"] == len(colours)
    for colour in colours:
        later = image_chat(solid_png(colour), "where is the square?", max_tokens=1)
        mine, theirs = chat(exact, later), chat(stock, later)
        # The first answer token is computed over every image token, as stock computes it.
        assert answer(mine) == answer(theirs)
        cached = mine["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= TEXT_BEFORE_IMAGE + IMAGE_TOKENS  # the image came from the host copy
    after = stats(exact)
    assert after["spans_recalled"] == before["spans_recalled"] + len(colours)
    assert after["images_prefilled"] == before["images_prefilled"], "an image encoded again"
    assert after["images_compressed"] == before["images_compressed"] + len(colours)
    assert after["spans_reused"] == before["spans_reused"]
    assert after["recall_bytes"] > before["recall_bytes"]
    # Each question compressed its own view, and at rest the device holds what it held before
    # (one compressed span per image): the views, questions and answers were freed.
    assert after["compressed_slots_held"] == before["compressed_slots_held"]
    assert available_slots(exact) == free_before
    metrics = requests.get(f"{exact.url}/metrics", timeout=10).text
    assert re.search(r"sglang_unicache_spans_recalled_total\S* [1-9]", metrics)


def test_kept_views_stay_in_the_tree_with_their_history(server_factory, tmp_path):
    config = tmp_path / "keep-views.yaml"
    config.write_text("selfcheck: false\nkeep_recalled_views: true\n")
    server = server_factory(*recall_flags(str(config), "--unicache-host-copies", "int8"))
    flush_cache(server)
    png = solid_png((140, 30, 200))
    chat(server, image_chat(png, "what colour is it?", max_tokens=4))
    before = stats(server)
    for question in ("where is the square?", "is it large?"):
        chat(server, image_chat(png, question, max_tokens=2))
    after = stats(server)
    assert after["spans_recalled"] == before["spans_recalled"] + 2
    # Each recalled question's K-entry view entered the tree beside the first one.
    held = after["compressed_slots_held"] - before["compressed_slots_held"]
    assert held == 2 * KEPT <= 0.15 * IMAGE_TOKENS * 2
    assert_integrity(server)


def test_an_agent_loop_encodes_each_screenshot_once(exact, tmp_path):
    """A new screenshot each step, the history resent: the second step recalls the first
    screenshot and compresses the second, and its KV enters the tree, so every later step
    reuses the earlier screenshots from the device instead of prefilling them again."""
    from examples import agent_screenshot

    flush_cache(exact)
    paths = []
    for i in range(4):
        path = tmp_path / f"screen{i}.png"
        path.write_bytes(solid_png((60 * i, 240 - 60 * i, 90)))
        paths.append(str(path))
    before = stats(exact)
    log = agent_screenshot.run(exact.url, paths, max_tokens=4)
    assert all(entry["answer"] is not None for entry in log)
    after = stats(exact)
    assert after["images_prefilled"] - before["images_prefilled"] == len(paths)
    assert after["spans_recalled"] - before["spans_recalled"] == 1  # the second step's
    assert after["spans_reused"] - before["spans_reused"] >= len(paths) - 2
    assert log[-1]["cached_tokens"] >= (len(paths) - 1) * IMAGE_TOKENS


def test_a_chat_turn_recalls_the_image_and_keeps_its_history(exact):
    flush_cache(exact)
    body = image_chat(solid_png((33, 144, 240)), "what colour is it?", max_tokens=6)
    first = chat(exact, body)
    messages = body["messages"] + [
        {"role": "assistant", "content": answer(first)},
        {"role": "user", "content": "is there a square?"}]
    before = stats(exact)
    second = chat(exact, {**body, "messages": messages})
    after = stats(exact)
    assert after["spans_recalled"] == before["spans_recalled"] + 1
    # The first turn's question and answer were copied from behind its compressed view.
    history = after["recall_history_tokens"] - before["recall_history_tokens"]
    assert history >= first["usage"]["completion_tokens"] + 4
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= TEXT_BEFORE_IMAGE + IMAGE_TOKENS + history
    assert after["images_prefilled"] == before["images_prefilled"]


def test_host_copies_never_cross_cache_salts(exact):
    flush_cache(exact)
    png = solid_png((5, 5, 250))
    chat(exact, image_chat(png, "what colour is it?", max_tokens=2, cache_salt="tenant-a"))
    before = stats(exact)
    chat(exact, image_chat(png, "describe it", max_tokens=2, cache_salt="tenant-b"))
    after = stats(exact)
    assert after["spans_recalled"] == before["spans_recalled"]
    assert after["images_prefilled"] == before["images_prefilled"] + 1
    chat(exact, image_chat(png, "describe it", max_tokens=2, cache_salt="tenant-a"))
    assert stats(exact)["spans_recalled"] == after["spans_recalled"] + 1


def test_an_evicted_host_copy_falls_back_to_the_compressed_span(one_copy):
    flush_cache(one_copy)
    first, second = solid_png((250, 120, 0)), solid_png((0, 120, 250))
    chat(one_copy, image_chat(first, "what colour is it?", max_tokens=2))
    chat(one_copy, image_chat(second, "what colour is it?", max_tokens=2))
    before = stats(one_copy)
    assert before["host_copies"] == 1 and before["host_copies_evicted"] >= 1
    assert before["host_copy_bytes"] == INT8_COPY_BYTES
    chat(one_copy, image_chat(first, "describe it", max_tokens=2))
    after = stats(one_copy)
    assert after["spans_recalled"] == before["spans_recalled"]  # its copy is gone
    assert after["spans_reused"] == before["spans_reused"] + 1  # the compressed span serves
    assert after["images_prefilled"] == before["images_prefilled"]
    chat(one_copy, image_chat(second, "describe it", max_tokens=2))
    assert stats(one_copy)["spans_recalled"] == after["spans_recalled"] + 1


def test_recalls_retracted_or_aborted_leak_nothing(one_copy):
    flush_cache(one_copy)
    baseline = available_slots(one_copy)
    png = solid_png((14, 200, 140))
    chat(one_copy, image_chat(png, "what colour is it?", max_tokens=2))
    recalled = stats(one_copy)["spans_recalled"]
    log_start = len(one_copy.log())  # only this workload's retractions count
    stream = image_chat(png, "tell me more", max_tokens=200, ignore_eos=True, stream=True)

    def hang_up() -> None:
        with requests.post(f"{one_copy.url}/v1/chat/completions", json=stream, stream=True,
                           timeout=120) as response:
            for line in response.iter_lines():
                if b'"content"' in line:
                    break

    bodies = [image_chat(png, f"question {i}", max_tokens=30, ignore_eos=True) for i in range(4)]
    with futures.ThreadPoolExecutor(2) as pool:
        hung = [pool.submit(hang_up) for _ in range(2)]
        outs = chat_all(one_copy, bodies, concurrency=4)
        for job in hung:
            job.result()
    assert all(o["usage"]["completion_tokens"] == 30 for o in outs)
    logged = one_copy.log()[log_start:]
    retracted = [int(n) for n in re.findall(r"#retracted_reqs: (\d+)", logged)]
    assert sum(retracted) > 0, "the workload did not retract any request"
    assert stats(one_copy)["spans_recalled"] > recalled
    assert stats(one_copy)["integrity"] == []
    flush_cache(one_copy, timeout=60)
    assert available_slots(one_copy) == baseline
