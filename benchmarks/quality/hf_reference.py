"""Reference answers from a saved checkpoint through plain transformers (no SGLang, no plugin).

The quality benchmark compares the server's ``full`` accuracy with these: the same checkpoint, the
same prompt (chat template: user turn with the image, then the question), greedy decoding. A large
gap means the serving path (processor, template, model port) differs from training, not that a
compression method lost information.

With ``press`` (a ``UniCacheConfig``) the answers come through
``sglang_unicache.adapters.transformers``: the library's plan applied to the transformers cache
after prefill, an implementation of compression independent of the server's (no pool, no compaction,
no radix tree), to compare the server's compressed accuracy with.

    from benchmarks.quality.hf_reference import hf_answers
    answers = hf_answers("runs/tiny-vqa-qwen2-vl", items, max_new_tokens=4)
    pressed = hf_answers(model, items, press=UniCacheConfig(method="snapkv", keep_ratio=0.1))
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path

from benchmarks.quality.vqa_data import VQAItem
from sglang_unicache.adapters.transformers import compress
from sglang_unicache.policy.config import UniCacheConfig


def hf_answers(model_dir: str | Path, items: Sequence[VQAItem], max_new_tokens: int = 12,
               press: UniCacheConfig | None = None) -> list[str]:
    """Greedy answers of the checkpoint in ``model_dir`` to ``items`` (one request per item,
    fp32, special tokens stripped, whitespace trimmed: the form the server's answers are scored
    in); compressed after each prefill by ``press`` when given."""
    import torch
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    processor = AutoProcessor.from_pretrained(model_dir)
    model = Qwen2VLForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    with compress(model, press) if press is not None else nullcontext():
        return [answer(model, processor, it, max_new_tokens) for it in items]


def answer(model, processor, it: VQAItem, max_new_tokens: int) -> str:
    import torch

    messages = [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": it.question}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[it.image], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1]:]
    return processor.tokenizer.decode(new, skip_special_tokens=True).strip()
