"""On both trained models, a later question recalling the image from an exact host copy answers
with stock SGLang's first token: its prefill sees every image token, as stock's does."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.quality.recall_agreement import agreement

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
