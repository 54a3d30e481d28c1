"""LLaVA-NeXT/OneVision requests (SGLang's ``LlavaBaseForCausalLM``): their image spans come from
the model's padding record, and a request that reuses a compressed span and still has an image to
encode after it is matched on its original ids (its features are placed by the ids as sent)."""

from __future__ import annotations

from types import SimpleNamespace

from sglang_unicache.engine.reuse import encodes_past_reused_spans
from sglang_unicache.engine.startup import item_offsets_from_padding


def mm(offsets=None, starts=(5, 150), lengths=(136, 136)):
    items = [SimpleNamespace(offsets=o) for o in (offsets or [None, None])]
    return SimpleNamespace(mm_items=items, image_offsets=list(starts),
                           image_pad_len=list(lengths))


def test_spans_are_copied_from_the_padding_record():
    inputs = mm()
    item_offsets_from_padding(inputs)
    assert [item.offsets for item in inputs.mm_items] == [[(5, 140)], [(150, 285)]]


def test_offsets_the_processor_set_are_kept():
    inputs = mm(offsets=[[(1, 9)], None])
    item_offsets_from_padding(inputs)
    assert [item.offsets for item in inputs.mm_items] == [[(1, 9)], None]


def test_an_image_after_the_reused_prefix_stops_reuse():
    inputs = mm(offsets=[[(5, 140)], [(150, 285)]])
    req = SimpleNamespace(multimodal_inputs=inputs, prefix_len=145, host_hit_length=0)
    assert encodes_past_reused_spans(req)
    req.prefix_len = 290  # both images in the reused prefix: nothing to encode
    assert not encodes_past_reused_spans(req)


def test_models_without_a_padding_record_keep_reuse():
    inputs = mm(offsets=[[(5, 140)], [(150, 285)]], lengths=())
    req = SimpleNamespace(multimodal_inputs=inputs, prefix_len=145, host_hit_length=0)
    assert not encodes_past_reused_spans(req)
    assert not encodes_past_reused_spans(SimpleNamespace(multimodal_inputs=None))
