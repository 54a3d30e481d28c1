"""The transformers entry point (``sglang_unicache.adapters.transformers``) on the bundled trained
Qwen2-VL: the same plan as the library, applied to the model's cache; method ``full`` changes no
token; a compressed cache holds fewer entries and still answers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.quality.vqa_data import make_split
from sglang_unicache.adapters.transformers import compress, image_spans
from sglang_unicache.policy.config import UniCacheConfig
from sglang_unicache.policy.inputs import ScoreInputs
from sglang_unicache.policy.registry import build_method

transformers = pytest.importorskip("transformers")

CHECKPOINT = Path(__file__).parents[2] / "assets" / "checkpoints" / "tiny-vqa-qwen2-vl"


@pytest.fixture(scope="module")
def vlm():
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    processor = AutoProcessor.from_pretrained(CHECKPOINT)
    model = Qwen2VLForConditionalGeneration.from_pretrained(
        CHECKPOINT, dtype=torch.float32, attn_implementation="sdpa").eval()
    items = make_split("test", 6, 1, seed=3, grid=8)
    prompts = []
    for item in items:
        messages = [{"role": "user", "content": [{"type": "image"},
                                                 {"type": "text", "text": item.question}]}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(processor(text=[text], images=[item.image], return_tensors="pt"))
    return model, prompts


def generate(model, prompt, tokens: int = 6) -> list[int]:
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=tokens, do_sample=False)
    return out[0, prompt["input_ids"].shape[1]:].tolist()


def prefill_cache(model, prompt):
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        model(**prompt, past_key_values=cache, use_cache=True)
    return cache


def test_method_full_changes_no_token(vlm) -> None:
    model, prompts = vlm
    stock = [generate(model, p) for p in prompts]
    with compress(model, "full") as record:
        pressed = [generate(model, p) for p in prompts]
    assert pressed == stock
    assert len(record.plans) == len(prompts) and record.kept_fraction == 1.0


def test_the_cache_holds_what_the_library_plans(vlm) -> None:
    """knorm at keep 0.25 through the press = the library's plan and executor on the same K/V."""
    model, prompts = vlm
    prompt = prompts[0]
    full = prefill_cache(model, prompt)
    spans = image_spans(prompt["input_ids"][0], {model.config.image_token_id})
    assert len(spans) == 1 and spans[0].length == 64
    keys = [layer.keys[0].transpose(0, 1) for layer in full.layers]
    values = [layer.values[0].transpose(0, 1) for layer in full.layers]
    method = build_method(UniCacheConfig(method="knorm", keep_ratio=0.25, selfcheck=False))
    plan = method.plan(ScoreInputs(keys, values, spans))
    expected = method.execute(plan.spans[0], keys, values)

    with compress(model, "knorm", keep_ratio=0.25, selfcheck=False) as record:
        pressed = prefill_cache(model, prompt)
    span = spans[0]
    t = keys[0].shape[0]
    for li, layer in enumerate(pressed.layers):
        got = layer.keys[0].transpose(0, 1)
        kept = expected.keys[li].shape[0]
        assert got.shape[0] == t - span.length + kept == t - 64 + 16
        torch.testing.assert_close(got[: span.start], keys[li][: span.start])
        torch.testing.assert_close(got[span.start : span.start + kept], expected.keys[li])
        torch.testing.assert_close(got[span.start + kept :], keys[li][span.end :])
    assert record.kept_fraction == pytest.approx(0.25)


def test_a_compressed_cache_still_answers(vlm) -> None:
    """UniCache keeping a tenth of the image: the answers stay mostly those of the full cache
    (measured 15/16 on 16 items; at least 4 of these 6), from a cache a tenth the size."""
    model, prompts = vlm
    stock = [generate(model, p) for p in prompts]
    with compress(model, "unicache", keep_ratio=0.1, selfcheck=False) as record:
        pressed = [generate(model, p) for p in prompts]
    assert sum(a == b for a, b in zip(pressed, stock, strict=True)) >= 4
    assert record.kept_fraction < 0.12
    assert record.image_tokens == 64 * len(prompts)


def test_the_hooks_are_gone_after_the_block(vlm) -> None:
    model, prompts = vlm
    with compress(model, "knorm", keep_ratio=0.1, selfcheck=False):
        pass
    cache = prefill_cache(model, prompts[0])
    assert cache.get_seq_length() == prompts[0]["input_ids"].shape[1]


def test_other_attention_implementations_are_refused_in_one_line(vlm) -> None:
    model, _ = vlm
    model.config._attn_implementation = "eager"
    try:
        with pytest.raises(ValueError, match="needs attn_implementation='sdpa'"):
            with compress(model, "knorm"):
                pass
    finally:
        model.config._attn_implementation = "sdpa"
