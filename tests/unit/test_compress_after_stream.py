"""A prefill's first tokens are streamed before its requests are compressed: the checkpoints
that compress wait for the end of ``process_batch_result_prefill`` (``hooks.py``), the others
run in place, and a failure while processing still runs the ones waiting."""

from types import SimpleNamespace

import pytest

from sglang_unicache.engine import hooks


class FakeController:
    def __init__(self, targets, events):
        self.targets, self.events = targets, events

    def defer_chunk_checkpoint(self, req):
        return False

    def compresses(self, req):
        return req.rid in self.targets

    def parks(self, req):  # overlap_compression off
        return False

    def on_checkpoint(self, req):
        if req.rid in self.targets:
            self.events.append(("compress", req.rid))

    def publish(self):
        pass


@pytest.fixture
def events(monkeypatch):
    events = []
    controller = FakeController({"img"}, events)
    monkeypatch.setattr(hooks, "STATE", hooks.PluginState(controller=controller))
    return events


def process_prefill(events, reqs, fail=False):
    """SGLang's order: each request's checkpoint (the tree insert), then the batch's stream."""

    def insert(req, tree_cache):
        events.append(("insert", req.rid))

    def original(processor, batch):
        for req in batch.reqs:
            hooks.around_checkpoint_kv_cache(insert, req, None)
        if fail:
            raise RuntimeError("boom")
        events.append(("stream", tuple(r.rid for r in batch.reqs)))

    batch = SimpleNamespace(reqs=[SimpleNamespace(rid=r) for r in reqs])
    return hooks.around_process_batch_result_prefill(original, None, batch)


def test_the_stream_comes_before_compression(events):
    process_prefill(events, ["text", "img"])
    assert events == [("insert", "text"), ("stream", ("text", "img")),
                      ("compress", "img"), ("insert", "img")]
    assert hooks.STATE.after_stream is None


def test_a_checkpoint_outside_a_prefill_result_compresses_in_place(events):
    hooks.around_checkpoint_kv_cache(lambda req, tc: events.append(("insert", req.rid)),
                                     SimpleNamespace(rid="img"), None)
    assert events == [("compress", "img"), ("insert", "img")]


def test_a_failure_still_runs_the_waiting_checkpoints(events):
    with pytest.raises(RuntimeError):
        process_prefill(events, ["img"], fail=True)
    assert events == [("compress", "img"), ("insert", "img")]  # no slot left uninserted
    assert hooks.STATE.after_stream is None
