"""``overlap_compression``: a compressing request sits out the build after its prefill and comes
back at the first build after its result was processed (``engine/parking.py``)."""

from types import SimpleNamespace

import pytest

from sglang_unicache.engine import parking
from sglang_unicache.engine.parking import Parking, parkable


def params(**changes):
    base = dict(frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0,
                min_new_tokens=0, logit_bias=None)
    return SimpleNamespace(**{**base, **changes})


class Req:
    def __init__(self, rid, **sampling):
        self.rid, self.output_ids, self.done = rid, [], False
        self.sampling_params = params(**sampling)
        self.grammar = None
        self.return_logprob = self.return_hidden_states = False

    def finished(self):
        return self.done


class Batch:
    """The part of SGLang's ScheduleBatch parking touches."""

    def __init__(self, reqs, extend=True):
        self.reqs, self.extend = list(reqs), extend
        self.forward_mode = SimpleNamespace(is_extend=lambda: self.extend)
        self.batch_is_full = True

    def batch_size(self):
        return len(self.reqs)

    def is_empty(self):
        return not self.reqs

    def filter_batch(self, reqs_to_exclude=()):
        self.reqs = [r for r in self.reqs if r not in reqs_to_exclude and not r.finished()]

    def merge_batch(self, other):
        self.reqs += other.reqs


def take_targets(req):  # the controller's Targets.take, as a stand-in
    return ("targets of", req.rid)


@pytest.fixture
def built(monkeypatch):
    """``decode_batch`` as a plain batch of the requests it was given."""
    monkeypatch.setattr(parking, "decode_batch", lambda scheduler, reqs: Batch(reqs, False))


def test_a_parked_request_sits_out_one_build_and_comes_back_after_its_result(built):
    scheduler = SimpleNamespace(running_batch=Batch([Req("decoding")], False))
    target, other = Req("target"), Req("other")
    prefill = Batch([target, other])
    park = Parking()
    assert park.park([target], take_targets)

    # The build after the prefill: the target leaves the prefill batch SGLang merges.
    running = park.rejoin(scheduler, scheduler.running_batch)
    park.exclude(prefill, scheduler.running_batch)
    assert [r.rid for r in prefill.reqs] == ["other"]
    assert [r.rid for r in running.reqs] == ["decoding"]
    assert scheduler.running_batch.batch_is_full is False  # room was made

    # Its result was processed before that build (first token out), its compression deferred;
    # at the next build it is compressed (its checkpoint takes its targets), then it is back.
    target.output_ids.append(7)
    compressed = []
    park.defer(target, lambda: compressed.append(park.take(target)))
    park.run_deferred()
    running = park.rejoin(scheduler, running)
    assert [r.rid for r in running.reqs] == ["decoding", "target"]
    assert compressed == [("targets of", "target")]
    assert park.parked == {} and park.parked_total == 1 and park.check() == []


def test_a_compression_deferred_at_the_build_it_sits_out_runs_at_the_next():
    """The prefill's result is processed before the build after it (its first token leaves
    then); its compression waits until that build has kept it out of a batch."""
    target = Req("target")
    park = Parking()
    park.park([target], take_targets)
    target.output_ids.append(3)
    ran = []
    park.defer(target, lambda: ran.append("compressed"))
    park.run_deferred()
    assert ran == []  # still fresh: this is the build it sits out
    park.exclude(Batch([target]), Batch([], False))
    park.run_deferred()
    assert ran == ["compressed"] and park.deferred == {}


def test_a_parked_request_keeps_its_targets_until_its_checkpoint_takes_them():
    """The loop processes a parked prefill's result after the next batch ran, and a next
    extend batch starts new targets: the parked ones wait in the parking, taken once."""
    target = Req("target")
    park = Parking()
    park.park([target], take_targets)
    assert park.holds(target) and park.check() == []
    assert park.take(target) == ("targets of", "target")
    assert not park.holds(target) and park.take(target) is None


def test_check_names_a_parked_request_that_left_without_its_compression():
    target = Req("target")
    park = Parking()
    park.park([target], take_targets)
    park.defer(target, lambda: None)
    del park.parked["target"]  # what a bug would leave: out of the parking, never compressed
    assert park.check() == ["parked request target left without its compression"]


def test_a_parked_request_is_not_back_before_its_result(built):
    target = Req("target")
    park = Parking()
    park.park([target], take_targets)
    park.exclude(Batch([target]), Batch([], False))
    running = park.rejoin(SimpleNamespace(), Batch([], False))
    assert running.reqs == [] and "target" in park.parked


def test_a_request_its_prefill_finished_is_dropped_not_rejoined(built):
    target = Req("target")
    park = Parking()
    park.park([target], take_targets)
    park.exclude(Batch([target]), Batch([], False))
    target.output_ids.append(2)
    target.done = True  # e.g. its first token was EOS: SGLang released it (compressing it)
    park.take(target)
    empty = Batch([], False)
    assert park.rejoin(SimpleNamespace(), empty) is empty and park.parked == {}


def test_a_running_batch_that_emptied_is_replaced_by_the_rejoining_one(built):
    target = Req("target")
    park = Parking()
    park.park([target], take_targets)
    park.exclude(Batch([target]), Batch([], False))
    target.output_ids.append(5)
    park.take(target)  # compressed
    running = park.rejoin(SimpleNamespace(), Batch([], False))
    assert [r.rid for r in running.reqs] == ["target"]


@pytest.mark.parametrize("sampling", [dict(frequency_penalty=0.5), dict(presence_penalty=0.1),
                                      dict(repetition_penalty=1.2), dict(min_new_tokens=4),
                                      dict(logit_bias={"3": 1.0})])
def test_requests_whose_sampling_state_follows_the_batch_are_not_parked(sampling):
    plain, penalised = Req("plain"), Req("penalised", **sampling)
    assert parkable(plain) and not parkable(penalised)
    park = Parking()
    # all or none: the prefill's result is processed first (overlap.py)
    assert not park.park([plain, penalised], take_targets)
    assert park.parked == {} and park.fresh == []


def test_an_abort_reaches_a_request_sitting_out_a_step(monkeypatch):
    """SGLang's own ``abort_request`` finds running requests through ``collect_inflight_reqs``;
    a parked request is in no batch for one step, so without the plugin's hook on it an abort
    sent then was lost and the request decoded to its end. With it, the request is marked to
    finish and leaves at its first step back, by SGLang's own path."""
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.io_struct import AbortReq
    from sglang.srt.managers.scheduler import Scheduler

    from sglang_unicache.engine import hooks

    target, decoding = Req("target-1"), Req("decoding")
    target.to_finish = decoding.to_finish = None
    park = Parking()
    park.park([target], take_targets)
    park.exclude(Batch([target]), Batch([], False))  # out of every batch now
    monkeypatch.setattr(hooks.STATE, "controller", SimpleNamespace(parking=park))

    scheduler = SimpleNamespace(
        chunked_req=None, mm_receiver=None, waiting_queue=[], dllm_config=None,
        grammar_manager=SimpleNamespace(abort_requests=lambda recv: None),
        disaggregation_mode=DisaggregationMode.NULL)
    scheduler.collect_inflight_reqs = lambda: hooks.around_collect_inflight_reqs(
        lambda s: {decoding}, scheduler)
    Scheduler.abort_request(scheduler, AbortReq(rid="target"))
    assert target.to_finish is not None and decoding.to_finish is None
