"""Reference answers from a saved checkpoint through plain transformers (no SGLang, no plugin).

The quality benchmark compares the server's ``full`` accuracy with these: the same checkpoint, the
same prompt (chat template: user turn with the image, then the question), greedy decoding. A large
gap means the serving path (processor, template, model port) differs from training, not that a
compression method lost information.

    from benchmarks.quality.hf_reference import hf_answers
    answers = hf_answers("runs/tiny-vqa-qwen2-vl", items, max_new_tokens=4)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from benchmarks.quality.vqa_data import VQAItem


def hf_answers(model_dir: str | Path, items: Sequence[VQAItem],
               max_new_tokens: int = 12) -> list[str]:
    """Greedy answers of the checkpoint in ``model_dir`` to ``items`` (one request per item,
    fp32, special tokens stripped, whitespace trimmed: the form the server's answers are scored
    in)."""
    import torch
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    processor = AutoProcessor.from_pretrained(model_dir)
    model = Qwen2VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    answers = []
    for it in items:
        messages = [{"role": "user", "content": [{"type": "image"},
                                                 {"type": "text", "text": it.question}]}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False)
        inputs = processor(text=[text], images=[it.image], return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        new = out[0, inputs["input_ids"].shape[1]:]
        answers.append(processor.tokenizer.decode(new, skip_special_tokens=True).strip())
    return answers
