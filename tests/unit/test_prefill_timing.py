"""A compressing prefill's time is its forward's: on CUDA the overlap scheduler's ``run_batch``
returns once the forward is queued, so the hook waits for the device before reading its clock
(else the prefill reads its launch and the compression after it carries the rest)."""

import time
from types import SimpleNamespace

import pytest

from sglang_unicache.engine import hooks
from sglang_unicache.engine.stats import Stats


class _Device:
    """torch.cuda as seen by the hook: a forward queued by ``run_batch`` finishes at
    ``synchronize``, which takes ``seconds``."""

    def __init__(self, initialized: bool, seconds: float):
        self.initialized, self.seconds, self.waits = initialized, seconds, 0

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return self.initialized

    def synchronize(self) -> None:
        self.waits += 1
        time.sleep(self.seconds)


@pytest.mark.parametrize("initialized", [True, False])
def test_a_timed_prefill_waits_for_the_device_before_its_clock_stops(monkeypatch, initialized):
    device = _Device(initialized, seconds=0.05)
    monkeypatch.setattr(hooks.torch, "cuda", device)
    stats = Stats()
    controller = SimpleNamespace(begin_forward=lambda batch: None,
                                 prefills_for_compression=lambda: True, stats=stats)
    monkeypatch.setattr(hooks.STATE, "controller", controller)
    batch = SimpleNamespace(forward_mode=SimpleNamespace(is_extend=lambda: True),
                            extend_lens=[300, 20])
    got = hooks.around_run_batch(lambda scheduler, b: "queued", None, batch)
    assert got == "queued" and stats.prefill_tokens == 320
    assert device.waits == (1 if initialized else 0)
    assert (stats.prefill_seconds >= 0.05) == initialized
