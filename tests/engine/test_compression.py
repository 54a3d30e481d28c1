"""Compression after prefill inside the real engine: identity cases, freed slots, no leaks."""

from __future__ import annotations

import concurrent.futures as futures
import re

import pytest
import requests

from tests.conftest import KEEP, KEPT
from tests.support.client import (
    answer,
    available_slots,
    chat,
    chat_all,
    flush_cache,
    internal_state,
)
from tests.support.images import data_url, image_chat, solid_png

IMAGE_TOKENS = 64


def two_image_chat(a: bytes, b: bytes, question: str, **params) -> dict:
    body = image_chat(a, question, **params)
    body["messages"][0]["content"].insert(1, {"type": "image_url",
                                             "image_url": {"url": data_url(b)}})
    return body


def text_chat(question: str) -> dict:
    return {"model": "default", "messages": [{"role": "user", "content": question}],
            "temperature": 0, "max_tokens": 10}


PALETTE = [(200, 30, 30), (30, 200, 30), (30, 30, 200), (200, 200, 30), (30, 200, 200),
           (200, 30, 200), (120, 60, 10), (10, 60, 120), (90, 90, 90), (250, 250, 250)]


def workload() -> list[dict]:
    """One-image, two-image and text-only chats, sent together."""
    pngs = [solid_png(c) for c in PALETTE[:4]]
    return [
        image_chat(pngs[0], "what colour is it?", max_tokens=10),
        two_image_chat(pngs[1], pngs[2], "compare them", max_tokens=10),
        text_chat("list three colours"),
        image_chat(pngs[3], "describe the picture", max_tokens=10),
        text_chat("what is a square?"),
    ]


@pytest.mark.parametrize("flags", [("--unicache-keep-ratio", "1.0"),
                                   ("--unicache-method", "full")])
def test_identity_settings_match_stock_tokens(server_factory, stock, flags):
    # keep 1.0 is the shared ``identity`` server (the soak compares it with stock too)
    server = server_factory("--unicache", *flags, keep=flags[0] == "--unicache-keep-ratio")
    expected = [answer(o) for o in chat_all(stock, workload())]
    got = [answer(o) for o in chat_all(server, workload())]
    assert got == expected
    assert internal_state(server)["unicache"]["images_compressed"] == 0


def test_same_image_twice_is_cached_with_identity_method(server_factory):
    server = server_factory("--unicache", "--unicache-method", "full", "--enable-cache-report")
    png = solid_png((240, 200, 10))
    chat(server, image_chat(png, "what colour is it?"))
    again = chat(server, image_chat(png, "what colour is it?"))
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= IMAGE_TOKENS


def test_compressed_request_holds_n_minus_k_fewer_slots(stock, compressing):
    body = image_chat(solid_png((12, 34, 56)), "what colour is it?", max_tokens=6)
    held = {}
    for name, server in (("stock", stock), ("unicache", compressing)):
        flush_cache(server)
        before = available_slots(server)
        out = chat(server, body)
        held[name] = before - available_slots(server)  # the finished request's KV, now in the tree
        assert out["usage"]["prompt_tokens"] > IMAGE_TOKENS  # usage counts the prompt as sent
    assert held["stock"] - held["unicache"] == IMAGE_TOKENS - KEPT


def test_request_finishing_at_prefill_enters_the_tree_compressed(stock, compressing):
    body = image_chat(solid_png((66, 6, 166)), "what colour is it?", max_tokens=1)
    held = {}
    for name, server in (("stock", stock), ("unicache", compressing)):
        flush_cache(server)
        before = available_slots(server)
        assert chat(server, body)["usage"]["completion_tokens"] == 1
        held[name] = before - available_slots(server)
    assert held["stock"] - held["unicache"] == IMAGE_TOKENS - KEPT


def test_batched_workload_compresses_every_image_and_leaks_nothing(compressing):
    flush_cache(compressing)
    baseline = available_slots(compressing)
    before = internal_state(compressing)["unicache"]
    outs = chat_all(compressing, workload())
    assert all(o["usage"]["completion_tokens"] > 0 for o in outs)
    after = internal_state(compressing)["unicache"]
    assert after["images_compressed"] - before["images_compressed"] == 4
    assert after["slots_freed"] - before["slots_freed"] == 4 * (IMAGE_TOKENS - KEPT)
    # Each compression's steps are timed (/server_info, the overhead benchmark's columns) and
    # lie within its whole.
    steps = {step: after[f"compress_{step}_seconds"] - before[f"compress_{step}_seconds"]
             for step in ("plan", "copy", "apply")}
    assert all(seconds > 0 for seconds in steps.values()), steps
    assert sum(steps.values()) <= after["compress_seconds"] - before["compress_seconds"]
    flush_cache(compressing)
    assert available_slots(compressing) == baseline


def test_the_overlap_scheduler_stays_on(compressing):
    """``--unicache`` keeps SGLang's overlap scheduler; a compressing prefill's result
    is processed before the next batch is built. The workloads above ran on it, and the
    fixture's integrity check (no slot both free and in the tree) holds after them."""
    info = requests.get(f"{compressing.url}/server_info", timeout=30).json()
    assert info["disable_overlap_schedule"] is False


def test_a_compressed_request_one_decode_from_its_limit_finishes(compressing):
    """Found under the overlap scheduler: SGLang skips the decode of a request whose queued
    result finishes it by length. A compressing prefill's result, processed early, had already
    committed its token, so a request with ``max_tokens`` 2 was dropped from the running batch
    (never finished; the scheduler died on the leaked row)."""
    flush_cache(compressing)
    baseline = available_slots(compressing)
    out = chat(compressing, image_chat(solid_png((3, 130, 70)), "what colour is it?",
                                       max_tokens=2, ignore_eos=True))
    assert out["usage"]["completion_tokens"] == 2
    flush_cache(compressing)
    assert available_slots(compressing) == baseline


def test_many_distinct_images_at_once(compressing):
    flush_cache(compressing)
    baseline = available_slots(compressing)
    before = internal_state(compressing)["unicache"]["images_compressed"]
    bodies = [image_chat(solid_png(c, size=224), "what colour is it?", max_tokens=8)
              for c in PALETTE]
    outs = chat_all(compressing, bodies, concurrency=len(bodies))
    assert all(o["usage"]["completion_tokens"] == 8 for o in outs)
    assert internal_state(compressing)["unicache"]["images_compressed"] - before == len(PALETTE)
    flush_cache(compressing)
    assert available_slots(compressing) == baseline


def test_aborted_requests_leak_nothing(compressing):
    """Clients that hang up mid-answer: SGLang aborts their requests, and every slot of their
    compressed images and their decode comes back. Each client closes its stream after the first
    token, so the abort is certain however fast the machine decodes (a fixed client timeout
    raced the decode and sometimes lost)."""
    flush_cache(compressing)
    baseline = available_slots(compressing)
    compressed = internal_state(compressing)["unicache"]["images_compressed"]
    body = image_chat(solid_png((1, 2, 3)), "describe it", max_tokens=400, ignore_eos=True,
                      stream=True)

    def hang_up_after_first_token() -> list[str]:
        seen = []
        with requests.post(f"{compressing.url}/v1/chat/completions", json=body, stream=True,
                           timeout=120) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if line.startswith(b"data: {"):
                    seen.append(line.decode())
                    if '"content"' in seen[-1]:
                        break
        return seen

    with futures.ThreadPoolExecutor(4) as pool:
        streams = list(pool.map(lambda _: hang_up_after_first_token(), range(4)))
    assert all(s and '"finish_reason":null' in s[-1].replace(" ", "") for s in streams)
    flush_cache(compressing, timeout=60)
    assert available_slots(compressing) == baseline
    assert internal_state(compressing)["unicache"]["images_compressed"] > compressed


def chunked(nocheck_config: str) -> tuple[str, ...]:
    """Chunked prefill in 32-token chunks: a 64-token image spans two."""
    return ("--unicache", "--unicache-method", "knorm", "--unicache-keep-ratio", str(KEEP),
            "--unicache-config", nocheck_config, "--chunked-prefill-size", "32")


def test_self_check_failure_falls_back_to_full_kv(server_factory, stock, tmp_path_factory,
                                                  nocheck_config):
    strict = tmp_path_factory.mktemp("cfg") / "strict.json"
    strict.write_text('{"selfcheck_threshold": 1e-12, "view_max_keep": 0}')  # the full ladder
    flags = ("--unicache", "--unicache-method", "knorm", "--unicache-keep-ratio", "0.1",
             "--unicache-config", str(strict))
    server_factory.prefetch(flags, chunked(nocheck_config))  # the next test's server too
    server = server_factory(*flags)
    body = image_chat(solid_png((77, 99, 11)), "what colour is it?", max_tokens=10)
    assert answer(chat(server, body)) == answer(chat(stock, body))
    stats = internal_state(server)["unicache"]
    assert stats["fallbacks"] >= 1 and stats["images_compressed"] == 0
    # keep 0.1 -> 0.141 -> 0.2 -> 0.283 -> 0.4 (the escalation cap) before the full KV was kept
    assert stats["escalations"] == 4 * stats["fallbacks"]
    check = stats["recent_checks"][-1]
    assert not check["passed"] and check["keep_ratio"] == 0.4 and check["escalations"] == 4


def test_image_split_across_prefill_chunks_is_compressed(server_factory, nocheck_config):
    server = server_factory(*chunked(nocheck_config))
    flush_cache(server)
    baseline = available_slots(server)
    before = internal_state(server)["unicache"]
    out = chat(server, image_chat(solid_png((5, 150, 90)), "what colour is it?", max_tokens=8))
    assert out["usage"]["completion_tokens"] == 8
    after = internal_state(server)["unicache"]
    assert after["images_compressed"] == before["images_compressed"] + 1
    assert after["slots_freed"] - before["slots_freed"] == IMAGE_TOKENS - KEPT
    # The prefill time compression is read against covers every chunk, not the last alone.
    prompt = out["usage"]["prompt_tokens"]
    assert after["prefill_tokens"] - before["prefill_tokens"] == prompt
    again = chat(server, image_chat(solid_png((5, 150, 90)), "describe it", max_tokens=4))
    assert internal_state(server)["unicache"]["spans_reused"] == after["spans_reused"] + 1
    # Usage counts the reused image as the user sent it (N tokens), not its K entries.
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= IMAGE_TOKENS
    flush_cache(server)
    assert available_slots(server) == baseline


def test_retracted_requests_are_recompressed_and_leak_nothing(server_factory, nocheck_config):
    # SGLang's test switch retracts running requests every few steps.
    server = server_factory("--unicache", "--unicache-method", "knorm", "--unicache-keep-ratio",
                            str(KEEP), "--unicache-config", nocheck_config,
                            env={"SGLANG_TEST_RETRACT": "1"})
    flush_cache(server)
    baseline = available_slots(server)
    bodies = [image_chat(solid_png(c), "describe it", max_tokens=30, ignore_eos=True)
              for c in PALETTE[:4]]
    outs = chat_all(server, bodies, concurrency=4)
    assert all(o["usage"]["completion_tokens"] == 30 for o in outs)
    retracted = [int(n) for n in re.findall(r"#retracted_reqs: (\d+)", server.log())]
    assert sum(retracted) > 0, "the workload did not retract any request"
    stats = internal_state(server)["unicache"]
    assert stats["images_compressed"] > len(bodies)  # retracted ones were compressed again
    flush_cache(server)
    assert available_slots(server) == baseline


def test_server_info_shows_the_config_in_effect(compressing):
    """A pool slot spans every layer, so the server fills every layer to the same count
    (``layer_fill: next``) whatever the config file says; ``/server_info`` says so."""
    assert internal_state(compressing)["unicache"]["config"]["layer_fill"] == "next"
