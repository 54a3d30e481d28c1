"""``--unicache --dp-size 2`` on CPU: each image is compressed once, on one replica,
and every later question about it goes there and reuses the span; each replica's stats name it,
and /metrics sums the replicas."""

from __future__ import annotations

import requests

from tests.support.client import chat, flush_cache
from tests.support.images import image_chat, solid_png

IMAGE_TOKENS = 64
KEPT = 16  # knorm at keep 0.25 of a 64-token image
# An odd number of images: round robin would send each image's next question to the other replica.
COLOURS = [(250, 10, 10), (10, 250, 10), (10, 10, 250), (250, 250, 10), (10, 250, 250)]


def replicas(server) -> list[dict]:
    states = requests.get(f"{server.url}/server_info", timeout=30).json()["internal_states"]
    return sorted((state["unicache"] for state in states), key=lambda s: s["dp_rank"])


def test_each_image_is_compressed_once_and_reused_on_its_replica(server_factory,
                                                                   nocheck_config) -> None:
    server = server_factory("--unicache", "--unicache-method", "knorm", "--unicache-keep-ratio",
                            "0.25", "--unicache-config", nocheck_config, "--dp-size", "2",
                            "--enable-metrics", "--enable-cache-report")
    flush_cache(server)
    before = replicas(server)
    assert [s["dp_rank"] for s in before] == [0, 1]
    for question in ("what colour is it?", "describe the picture", "what shape is it?"):
        for colour in COLOURS:
            out = chat(server, image_chat(solid_png(colour), question, max_tokens=2))
            if question != "what colour is it?":  # a repeat: served from the cached span
                assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= IMAGE_TOKENS
    after = replicas(server)
    grew = [{key: a[key] - b[key] for key in ("images_compressed", "spans_reused",
                                               "images_prefilled")}
            for a, b in zip(after, before, strict=True)]
    assert sum(g["images_compressed"] for g in grew) == len(COLOURS)  # once each, in all
    assert sum(g["images_prefilled"] for g in grew) == len(COLOURS)  # encoded once each
    assert sum(g["spans_reused"] for g in grew) == 2 * len(COLOURS)
    assert all(g["images_compressed"] >= 1 for g in grew), "every image on one replica"
    assert all(state["integrity"] == [] for state in after)

    held = sum(state["compressed_slots_held"] for state in after)
    assert held == KEPT * len(COLOURS)
    metrics = requests.get(f"{server.url}/metrics", timeout=30).text
    gauge = [float(line.split()[-1]) for line in metrics.splitlines()
             if line.startswith("sglang_unicache_compressed_slots_held")]
    assert gauge == [held], "the gauge is the sum over the replicas"


def test_an_idle_dp_controller_sleeps(server_factory, nocheck_config) -> None:
    """SGLang's data-parallel controller polls its socket without blocking; on a 2-core host an
    idle ``--dp-size 2`` server took a whole core (and a test run with two of them alive timed
    out starting the next server). With ``sleep_on_idle`` (the CPU platform's default) it
    blocks until a request comes."""
    import time

    import psutil

    server = server_factory("--unicache", "--unicache-method", "knorm", "--unicache-keep-ratio",
                            "0.25", "--unicache-config", nocheck_config, "--dp-size", "2",
                            "--enable-metrics", "--enable-cache-report")
    chat(server, image_chat(solid_png(COLOURS[0]), "what colour is it?", max_tokens=2))
    controllers = [p for p in psutil.Process(server.process.pid).children(recursive=True)
                   if "data_parallel_controller" in " ".join(p.cmdline())]
    assert len(controllers) == 1
    before = sum(controllers[0].cpu_times()[:2])
    time.sleep(5)
    busy = sum(controllers[0].cpu_times()[:2]) - before
    assert busy < 1.0, f"the idle controller used {busy:.1f} s of CPU in 5 s"


def test_later_questions_recall_on_the_replica_holding_the_copy(server_factory,
                                                                nocheck_config) -> None:
    server = server_factory("--unicache", "--unicache-keep-ratio", "0.1", "--unicache-config",
                            nocheck_config, "--dp-size", "2", "--enable-cache-report")
    flush_cache(server)
    before = replicas(server)
    for question in ("what colour is it?", "describe the picture"):
        for colour in COLOURS:
            chat(server, image_chat(solid_png(colour), question, max_tokens=2))
    after = replicas(server)
    grew = [{key: a[key] - b[key] for key in ("spans_recalled", "images_prefilled",
                                               "host_copies_stored")}
            for a, b in zip(after, before, strict=True)]
    assert sum(g["host_copies_stored"] for g in grew) == len(COLOURS)
    assert sum(g["spans_recalled"] for g in grew) == len(COLOURS)  # each on its copy's replica
    assert sum(g["images_prefilled"] for g in grew) == len(COLOURS)  # encoded once each
    assert all(state["integrity"] == [] for state in after)


def test_dp_routing_false_gives_sglang_its_routing_back(server_factory, tmp_path_factory) -> None:
    """Round robin again: with an odd number of images each image's next question goes to the
    other replica, which encodes and compresses it a second time."""
    config = tmp_path_factory.mktemp("cfg") / "round_robin.yaml"
    config.write_text("selfcheck: false\ndp_routing: false\n")
    server = server_factory("--unicache", "--unicache-method", "knorm", "--unicache-keep-ratio",
                            "0.25", "--unicache-config", str(config), "--dp-size", "2")
    flush_cache(server)
    before = sum(s["images_compressed"] for s in replicas(server))
    for question in ("what colour is it?", "describe the picture"):
        for colour in COLOURS:
            chat(server, image_chat(solid_png(colour), question, max_tokens=2))
    after = replicas(server)
    assert sum(s["images_compressed"] for s in after) - before == 2 * len(COLOURS)
    assert all(state["integrity"] == [] for state in after)
