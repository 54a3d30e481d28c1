"""Each example runs against the CPU server (or an offline Engine) and does what it says."""

from __future__ import annotations

from examples import agent_screenshot, offline_batch, sgl_multiturn
from sglang_unicache.testing.client import internal_state
from sglang_unicache.testing.images import solid_png
from tests.conftest import KEPT


def test_sgl_multiturn_reuses_the_image(compressing, tmp_path):
    path = tmp_path / "img.png"
    path.write_bytes(solid_png((10, 220, 120)))
    before = internal_state(compressing)["unicache"]["spans_reused"]
    turns = sgl_multiturn.run(compressing.url, str(path), ["what colour?", "describe it",
                                                           "where is it?"], max_tokens=4)
    assert [t["meta"]["completion_tokens"] for t in turns] == [4, 4, 4]
    assert internal_state(compressing)["unicache"]["spans_reused"] > before


def test_agent_loop_reuses_the_screenshot(compressing, tmp_path):
    path = tmp_path / "screen.png"
    path.write_bytes(solid_png((240, 240, 240)))
    log = agent_screenshot.run(compressing.url, str(path), max_tokens=4)
    assert len(log) == len(agent_screenshot.STEPS)
    assert all(entry["answer"] is not None for entry in log)
    assert log[0]["cached_tokens"] < KEPT
    assert all(entry["cached_tokens"] >= KEPT for entry in log[1:])


def test_offline_batch_example(engine, tiny_model, tmp_path):
    paths = []
    for i, colour in enumerate([(200, 0, 0), (0, 0, 200)]):
        path = tmp_path / f"{i}.png"
        path.write_bytes(solid_png(colour))
        paths.append(str(path))
    outs = offline_batch.run(engine, str(tiny_model), paths, max_new_tokens=5)
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [5, 5]
