"""A server whose self-check keeps most images at full KV says so, once per window."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("sglang")

from sglang_unicache.engine.controller import Controller  # noqa: E402
from sglang_unicache.engine.outcomes import FALLBACK_WINDOW  # noqa: E402
from sglang_unicache.policy.config import UniCacheConfig  # noqa: E402


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_one_warning_per_window_when_most_images_fall_back(caplog):
    controller = Controller(UniCacheConfig(), None, None, None)
    with caplog.at_level(logging.WARNING, logger="sglang_unicache"):
        for _ in range(FALLBACK_WINDOW - 1):
            controller.outcomes.record(True)
        assert warnings_of(caplog) == []  # not a full window yet
        controller.outcomes.record(True)
        assert len(warnings_of(caplog)) == 1
        message = warnings_of(caplog)[0]
        assert f"{FALLBACK_WINDOW} of the last {FALLBACK_WINDOW} image requests kept their full" \
               in message and "selfcheck_threshold" in message and "escalate_max_keep" in message
        for _ in range(FALLBACK_WINDOW - 1):
            controller.outcomes.record(True)
        assert len(warnings_of(caplog)) == 1  # once per window, not once per request
        controller.outcomes.record(True)
        assert len(warnings_of(caplog)) == 2


def test_no_warning_while_most_images_are_compressed(caplog):
    controller = Controller(UniCacheConfig(), None, None, None)
    with caplog.at_level(logging.WARNING, logger="sglang_unicache"):
        for i in range(3 * FALLBACK_WINDOW):
            controller.outcomes.record(i % 3 == 0)  # a third fall back
    assert warnings_of(caplog) == []
