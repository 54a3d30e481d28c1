"""Each example runs against the CPU server (or an offline Engine) and does what it says."""

from __future__ import annotations

from examples import agent_screenshot, offline_batch, sgl_multiturn
from tests.conftest import KEPT
from tests.support.client import answer, chat, flush_cache, internal_state
from tests.support.images import data_url, solid_png


def test_sgl_multiturn_reuses_the_image(compressing, tmp_path):
    path = tmp_path / "img.png"
    path.write_bytes(solid_png((10, 220, 120)))
    before = internal_state(compressing)["unicache"]["spans_reused"]
    turns = sgl_multiturn.run(compressing.url, str(path), ["what colour?", "describe it",
                                                           "where is it?"], max_tokens=4)
    assert [t["meta"]["completion_tokens"] for t in turns] == [4, 4, 4]
    assert internal_state(compressing)["unicache"]["spans_reused"] > before


def test_agent_loop_compresses_every_screenshot_once_and_reuses_the_earlier_ones(
        compressing, tmp_path):
    """Six steps, a new screenshot each: each is compressed exactly once, held as K slots once,
    and every later step reuses all earlier ones, not only the first."""
    flush_cache(compressing)
    paths = []
    for i in range(6):
        path = tmp_path / f"screen{i}.png"
        path.write_bytes(solid_png((40 * i, 250 - 40 * i, 90)))
        paths.append(str(path))
    before = internal_state(compressing)["unicache"]
    log = agent_screenshot.run(compressing.url, paths, max_tokens=4)
    assert all(entry["answer"] is not None for entry in log)
    for step, entry in enumerate(log):
        assert entry["images_compressed"] - before["images_compressed"] == step + 1
        # step s reuses the s earlier screenshots: 0 + 1 + ... + s reuses in all
        assert entry["spans_reused"] - before["spans_reused"] == step * (step + 1) // 2
        assert entry["compressed_slots_held"] == KEPT * (step + 1), "a screenshot held twice"
    assert log[-1]["cached_tokens"] >= 5 * 64, "usage counts reused screenshots as sent"
    after = internal_state(compressing)["unicache"]
    assert after["images_prefilled"] - before["images_prefilled"] == 6


def test_two_new_images_in_one_turn_are_both_compressed(compressing):
    flush_cache(compressing)
    pngs = [solid_png(c) for c in ((1, 2, 200), (200, 2, 1), (2, 200, 1), (90, 90, 9))]
    before = internal_state(compressing)["unicache"]

    def turn(images, question):
        return {"role": "user", "content": [
            *({"type": "image_url", "image_url": {"url": data_url(p)}} for p in images),
            {"type": "text", "text": question}]}

    messages = [turn(pngs[:1], "what is this?")]
    held = []
    for images in (pngs[1:3], pngs[3:]):
        out = chat(compressing, {"model": "default", "messages": messages, "temperature": 0,
                                 "max_tokens": 3})
        held.append(internal_state(compressing)["unicache"]["compressed_slots_held"])
        messages = [*messages, {"role": "assistant", "content": answer(out)},
                    turn(images, "and these?")]
    chat(compressing, {"model": "default", "messages": messages, "temperature": 0,
                       "max_tokens": 3})
    after = internal_state(compressing)["unicache"]
    assert after["images_compressed"] - before["images_compressed"] == 4
    assert held == [KEPT, 3 * KEPT] and after["compressed_slots_held"] == 4 * KEPT
    assert after["spans_reused"] - before["spans_reused"] == 1 + 3


def test_offline_batch_example(engine, tiny_model, tmp_path):
    paths = []
    for i, colour in enumerate([(200, 0, 0), (0, 0, 200)]):
        path = tmp_path / f"{i}.png"
        path.write_bytes(solid_png(colour))
        paths.append(str(path))
    before = offline_batch.unicache_stats(engine)
    outs = offline_batch.run(engine, str(tiny_model), paths, max_new_tokens=5)
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [5, 5]
    after = offline_batch.unicache_stats(engine)
    # It reports what happened: each image compressed or, past the self-check, kept whole.
    compressed = after["images_compressed"] - before["images_compressed"]
    assert compressed + after["fallbacks"] - before["fallbacks"] == 2
    assert f"compressed {after['images_compressed']} image(s)" in offline_batch.summary(after)
