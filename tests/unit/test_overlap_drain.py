"""The overlap scheduler with compression: a prefill whose requests are compressed has its result
processed before the next batch is built, in order, and exactly once (``overlap.py``)."""

from collections import deque
from types import SimpleNamespace

import pytest

from sglang_unicache.engine import hooks


class FakeScheduler:
    """The two methods the overlap loop calls around our hooks, with the hooks applied."""

    def __init__(self):
        self.result_queue = deque()
        self.processed = []
        self.built = []

    def _process(self, batch, result):
        self.processed.append(result)

    def process_batch_result(self, batch, result):
        return hooks.around_process_batch_result(
            lambda s, b, r: s._process(b, r), self, batch, result)

    def get_next_batch_to_run(self):
        def build(s, running_batch=None, last_batch=None):
            s.built.append(list(s.processed))  # what had been processed when the batch was built

        return hooks.around_get_next_batch_to_run(build, self)

    def pop_and_process(self):  # event_loop_overlap's closure
        batch, result = self.result_queue.popleft()
        self.process_batch_result(batch, result)


@pytest.fixture
def state(monkeypatch):
    monkeypatch.setattr(hooks, "STATE", hooks.PluginState(controller=SimpleNamespace(parking=None)))
    return hooks.STATE


def test_a_compressing_prefill_is_processed_before_the_next_batch_is_built(state):
    scheduler = FakeScheduler()
    decode, prefill = object(), object()
    batches = [SimpleNamespace(reqs=["a"]), SimpleNamespace(reqs=["a", "b"])]
    scheduler.result_queue.extend(zip(batches, [decode, prefill], strict=True))
    state.overlap.compresses(prefill)

    scheduler.get_next_batch_to_run()
    assert scheduler.built == [[decode, prefill]]  # both, in queue order, before the build
    # SGLang reads the queued batch's requests as not having their token yet: they have it.
    assert [b.reqs for b in batches] == [[], []]

    scheduler.pop_and_process()
    scheduler.pop_and_process()
    assert scheduler.processed == [decode, prefill]  # not processed a second time
    assert state.overlap.compressing == [] and state.overlap.processed_early == []


def test_other_batches_keep_the_overlap(state):
    scheduler = FakeScheduler()
    decode = object()
    batch = SimpleNamespace(reqs=["a"])
    scheduler.result_queue.append((batch, decode))

    scheduler.get_next_batch_to_run()
    assert scheduler.built == [[]]  # nothing processed ahead of the loop
    assert batch.reqs == ["a"]

    scheduler.pop_and_process()
    assert scheduler.processed == [decode]


def test_without_the_plugin_nothing_is_drained(monkeypatch):
    monkeypatch.setattr(hooks, "STATE", hooks.PluginState())
    scheduler = FakeScheduler()
    prefill = object()
    scheduler.result_queue.append((SimpleNamespace(reqs=["a"]), prefill))
    hooks.STATE.overlap.compresses(prefill)

    scheduler.get_next_batch_to_run()
    assert scheduler.built == [[]]
