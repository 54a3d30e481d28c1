"""HiCache with compressed spans: ``--enable-hierarchical-cache`` on the CPU platform,
stock and with ``--unicache``. A device pool too small for the stream demotes compressed spans
to host memory; a later question about an early image loads its span back (not recomputed),
answers exactly as a device hit does, and every slot and span stays accounted for."""

from __future__ import annotations

import pytest

from tests.conftest import KEEP, assert_integrity
from tests.support.client import answer, chat, internal_state
from tests.support.images import image_chat, solid_png

POOL = 640  # ~8 uncompressed prompts of the tiny model (64 image tokens each)
IMAGES = 30  # compressed at 25% about 20 fit: the first ones go to the host tier
IMAGE_TOKENS = 64
HICACHE = ["--max-total-tokens", str(POOL), "--enable-hierarchical-cache", "--hicache-size", "1"]


def picture(i: int) -> bytes:
    return solid_png((20 + 7 * i, 200 - 5 * i, (40 * i) % 256))


def second_asks(server) -> list[dict]:
    for i in range(IMAGES):
        chat(server, image_chat(picture(i), "what colour is it?", max_tokens=1))
    return [chat(server, image_chat(picture(i), "what shape is it?", max_tokens=6))
            for i in range(IMAGES)]


def cached(out: dict) -> int:
    return out["usage"]["prompt_tokens_details"]["cached_tokens"]


def compressing_hicache(nocheck_config: str) -> tuple[str, ...]:
    return ("--unicache", "--unicache-method", "knorm", "--unicache-keep-ratio", str(KEEP),
            "--unicache-config", nocheck_config, *HICACHE)


@pytest.fixture
def hicache_unicache(server_factory, nocheck_config):
    server = server_factory(*compressing_hicache(nocheck_config))
    yield server
    assert_integrity(server)


def test_stock_hicache_runs_on_the_cpu_platform(server_factory, nocheck_config):
    """The platform's host pool and transfers: stock SGLang keeps every image of a stream
    that overflows the device pool, and a later question hits it in host memory."""
    server_factory.prefetch(tuple(HICACHE), compressing_hicache(nocheck_config))
    server = server_factory(*HICACHE)
    outs = second_asks(server)
    assert all(cached(out) >= IMAGE_TOKENS for out in outs), [cached(o) for o in outs]


def test_compressed_spans_go_to_host_memory_and_load_back_exactly(hicache_unicache, compressing):
    outs = second_asks(hicache_unicache)
    state = internal_state(hicache_unicache)["unicache"]
    assert state["images_compressed"] == IMAGES
    assert state["spans_reused"] == IMAGES, "a span was recomputed instead of loaded back"
    assert state["images_prefilled"] == IMAGES, "an image was encoded again"
    assert state["spans_loaded_back"] >= 5, state  # the early images came from host memory
    assert all(cached(out) >= IMAGE_TOKENS for out in outs)
    # The same questions on a pool that holds every span (device hits only): the loaded-back
    # spans hold exactly the entries compression kept.
    reference = second_asks(compressing)
    assert [answer(o) for o in outs] == [answer(o) for o in reference]
    assert internal_state(compressing)["unicache"]["spans_loaded_back"] == 0


def host_pool_tokens(server) -> int:
    """Tokens HiCache's host pool was sized for (its startup log line)."""
    import re

    found = re.search(r"hierarchical KV host pool: (\d+) tokens", server.log())
    assert found, "no host pool in the log"
    return int(found.group(1))


def test_int8_host_copies_hold_more_slots_and_answer_as_bf16(server_factory, hicache_unicache,
                                                             tmp_path_factory, tiny_model):
    """``host_quantization: int8`` (seed §6.3): the same 1 GB host pool holds (2 D) / (D + 2)
    times the slots, and the spans loaded back from int8 answer as those from bf16 copies."""
    import json

    path = tmp_path_factory.mktemp("cfg") / "int8.yaml"
    path.write_text("selfcheck: false\nhost_quantization: int8\n")
    server = server_factory("--unicache", "--unicache-method", "knorm", "--unicache-keep-ratio",
                            str(KEEP), "--unicache-config", str(path), "--enable-cache-report",
                            *HICACHE)
    outs = second_asks(server)
    state = internal_state(server)["unicache"]
    assert state["integrity"] == [] and state["spans_reused"] == IMAGES
    assert state["spans_loaded_back"] >= 5, state
    cfg = json.loads((tiny_model / "config.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    ratio = host_pool_tokens(server) / host_pool_tokens(hicache_unicache)
    assert ratio == pytest.approx(2 * head_dim / (head_dim + 2), rel=0.01)
    reference = second_asks(hicache_unicache)
    same = sum(answer(a) == answer(b) for a, b in zip(outs, reference, strict=True))
    assert same >= IMAGES - 2, f"{same} of {IMAGES} answers as with bf16 host copies"
