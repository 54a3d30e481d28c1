"""On both trained models, a later question recalling the image from an exact host copy answers
with stock SGLang's first token: its prefill sees every image token, as stock's does. As shipped,
an image the check escalated goes back to the keep ratio at rest."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from PIL import Image

from benchmarks.quality.recall_agreement import agreement
from tests.support.client import answer, chat, internal_state
from tests.support.images import image_chat
from tests.support.server import start_server

CHECKPOINTS = Path(__file__).resolve().parents[2] / "assets" / "checkpoints"
IMAGES, QUESTIONS = 4, 3


@pytest.mark.parametrize("model", ["tiny-vqa-qwen2-vl", "tiny-grid-qwen2-vl"])
def test_later_questions_answer_as_stock_with_exact_copies(model, server_factory, tmp_path):
    server_factory.make_room(1)  # one server of its own at a time
    servers = {"stock": ["--enable-cache-report"],
               "exact": ["--unicache", "--unicache-host-copies", "exact",
                         "--enable-cache-report"]}
    _, exact = agreement(str(CHECKPOINTS / model), servers, IMAGES, QUESTIONS, tmp_path)
    later = IMAGES * (QUESTIONS - 1)
    assert exact["later_questions"] == later
    assert exact["spans_recalled"] == later  # every later question recalled its image
    assert exact["images_prefilled"] == IMAGES  # each image encoded once, by its first question
    assert exact["same_first_token"] == later, exact


def readme_square() -> bytes:
    """The README's example image: a plain blue square, whose second question's check fails at
    its first rung (keep 0.141)."""
    out = io.BytesIO()
    Image.new("RGB", (224, 224), (30, 30, 200)).save(out, "PNG")
    return out.getvalue()


def test_an_escalated_span_rests_at_the_keep_ratio_and_keeps_its_chat(server_factory, tmp_path):
    """With the ladder unbounded (``view_max_keep: 0``) the README's blue square's first
    question decodes on a view of 9 entries (keep 0.141, the ladder's first rung:
    ``view_rungs``), which passes the check; its second question's check fails there and
    climbs to 13. Once each request is done the device keeps round(0.1 x 64) = 6 entries: the
    host copy serves later questions over the whole image. The chat's first turn stays cached
    behind the span, so the next turn recalls it as history."""
    server_factory.make_room(1)
    config = tmp_path / "unbounded.json"
    config.write_text('{"view_max_keep": 0}')
    server = start_server(CHECKPOINTS / "tiny-vqa-qwen2-vl",
                          ["--unicache", "--unicache-config", str(config),
                           "--enable-cache-report"], tmp_path / "unbounded.log")
    try:
        first = image_chat(readme_square(), "what colour is the square?", max_tokens=8)
        reply = chat(server, first)
        state = internal_state(server)["unicache"]
        check = state["recent_checks"][-1]
        assert check["passed"] and check["escalations"] == 0
        assert round(check["keep_ratio"] * 64) == 9  # the first rung, within 0.15x of the image
        assert state["spans_shrunk_at_rest"] == 1
        assert state["compressed_slots_held"] == 6

        first["messages"] += [{"role": "assistant", "content": answer(reply)},
                              {"role": "user", "content": "how many objects are there?"}]
        chat(server, first)
        state = internal_state(server)["unicache"]
        assert state["spans_recalled"] == 1 and state["recall_history_tokens"] > 0
        assert state["images_prefilled"] == 1  # the image was encoded once
        # its own view climbs from 9 entries to 13, one escalation in all
        assert round(state["recent_checks"][-1]["keep_ratio"] * 64) == 13
        assert state["escalations"] == 1
        assert state["compressed_slots_held"] == 6  # the recalled view left with its request
        assert state["integrity"] == []
    finally:
        server.stop()


@pytest.mark.parametrize("copies,view_entries,shrunk", [("int8", 9, 1), ("off", 6, 0)])
def test_a_view_planned_above_the_keep_ratio_rests_at_it(copies, view_entries, shrunk,
                                                         server_factory, tmp_path):
    """``view_rungs`` as shipped: with host copies a request decodes on a view of 9 entries (one
    rung above keep 0.1) and its span goes back to keep 0.1's 6 once it is done; without them
    the view is the span later questions share, so it is planned at the keep ratio."""
    server_factory.make_room(1)
    config = tmp_path / "view.json"
    config.write_text('{"selfcheck_threshold": 1e9, "view_max_keep": 0}')  # checked, passing
    server = start_server(CHECKPOINTS / "tiny-vqa-qwen2-vl",
                          ["--unicache", "--unicache-config", str(config),
                           "--unicache-host-copies", copies], tmp_path / "view.log")
    try:
        chat(server, image_chat(readme_square(), "what colour is the square?", max_tokens=8))
        state = internal_state(server)["unicache"]
        check = state["recent_checks"][-1]
        assert check["escalations"] == 0 and round(check["keep_ratio"] * 64) == view_entries
        assert state["spans_shrunk_at_rest"] == shrunk
        assert state["compressed_slots_held"] == 6
        assert state["integrity"] == []
    finally:
        server.stop()


def test_as_shipped_a_view_decodes_within_its_bound(server_factory, tmp_path):
    """The shipped ``view_max_keep`` (0.15 with host copies): the blue square's second question,
    whose view climbs from 9 entries to 13 on the unbounded ladder (above), takes no rung past
    0.15x of the image: it decodes on 9 entries, unchecked at the top of its ladder, and never
    falls back; the first question keeps its chat, so the second recalls it as history."""
    server_factory.make_room(1)
    server = start_server(CHECKPOINTS / "tiny-vqa-qwen2-vl",
                          ["--unicache", "--enable-cache-report"], tmp_path / "shipped.log")
    try:
        first = image_chat(readme_square(), "what colour is the square?", max_tokens=8)
        reply = chat(server, first)
        before = internal_state(server)["unicache"]
        assert before["slots_freed"] == 64 - 9  # its view: 9 entries of 64
        first["messages"] += [{"role": "assistant", "content": answer(reply)},
                              {"role": "user", "content": "how many objects are there?"}]
        chat(server, first)
        state = internal_state(server)["unicache"]
        assert state["spans_recalled"] == 1 and state["images_prefilled"] == 1
        assert state["recall_history_tokens"] > 0
        assert state["slots_freed"] - before["slots_freed"] == 64 - 9  # 9 entries, not 13
        assert state["escalations"] == 0 and state["fallbacks"] == 0
        assert state["recent_checks"] == []  # at the top of its ladder nothing is checked
        assert state["views_unchecked"] == 2  # both questions' views, counted for /metrics
        assert state["compressed_slots_held"] == 6
        assert state["integrity"] == []
    finally:
        server.stop()
