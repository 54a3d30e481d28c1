"""``--kv-cache-dtype fp8_e4m3`` with ``--unicache``: the policy scores the dequantized pool,
writes entries back in the pool's dtype, and the self-check is not tripped by quantization (an
evicted span holds exactly the values the pool held). ``fp8_e5m2`` takes the same serving path;
its dtype's reads and writes on a real SGLang pool are ``tests/unit/test_compaction.py``'s."""

from __future__ import annotations

import pytest

from tests.conftest import KEPT, assert_integrity
from tests.support.client import answer, chat, flush_cache, internal_state
from tests.support.images import image_chat, solid_png


def test_a_float8_pool_compresses_and_reuses(server_factory, nocheck_config):
    server = server_factory("--unicache", "--unicache-method", "knorm", "--unicache-keep-ratio",
                            "0.25", "--unicache-config", nocheck_config, "--kv-cache-dtype",
                            "fp8_e4m3")
    flush_cache(server)
    png = solid_png((90, 200, 10))
    first = answer(chat(server, image_chat(png, "what colour is it?", max_tokens=4)))
    state = internal_state(server)["unicache"]
    assert state["images_compressed"] == 1 and state["errors"] == 0
    assert state["compressed_slots_held"] == KEPT
    again = answer(chat(server, image_chat(png, "what colour is it?", max_tokens=4)))
    assert again == first  # the reused compressed span answers as the fresh one did
    assert internal_state(server)["unicache"]["spans_reused"] == 1
    assert_integrity(server)


def test_float8_adds_no_self_check_failures_of_its_own(server_factory):
    """The shipped defaults (self-check on) with and without an fp8 pool, the same image: the
    check reaches the same verdict at the same keep ratio and measures about the same KL
    (eviction keeps the stored values; only the pool's own rounding differs). The view is left
    unbounded, so the check runs: at keep 0.25 the bound would leave it nothing to check."""
    flags = ("--unicache", "--unicache-keep-ratio", "0.25", "--unicache-view-max-keep", "0")
    server_factory.prefetch(flags, (*flags, "--kv-cache-dtype", "fp8_e4m3"))
    checks = []
    for server in (server_factory(*flags), server_factory(*flags, "--kv-cache-dtype", "fp8_e4m3")):
        flush_cache(server)
        chat(server, image_chat(solid_png((9, 99, 199)), "describe it", max_tokens=2))
        state = internal_state(server)["unicache"]
        assert state["errors"] == 0
        checks.append(state["recent_checks"][-1])
        assert_integrity(server)
    auto, fp8 = checks
    assert fp8["passed"] == auto["passed"] and fp8["keep_ratio"] == auto["keep_ratio"]
    # The pool's own fp8 rounding moves the model's attention a little (measured: KL 0.369 with
    # fp8_e4m3 vs 0.426 with the default dtype, threshold 0.9); eviction adds nothing to it.
    assert fp8["value"] == pytest.approx(auto["value"], abs=0.1)
