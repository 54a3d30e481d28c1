"""An independent reference for compressed decoding: transformers with a pruned cache.

Given a prompt (one image + a question) and, per layer, the span-relative entries each KV head
keeps, it prefills with transformers, replaces the image span of every layer's cache with exactly
those entries, and decodes greedily with every new token at its original position (M-RoPE for
Qwen2-VL, 1-D for LLaVA). SGLang serving the same checkpoint with the same kept set must produce
the same tokens.
"""

from __future__ import annotations

import io

import torch


def load(model_dir, dtype=torch.float32):
    """The checkpoint in transformers: Qwen2-VL (M-RoPE) or LLaVA (1-D RoPE), and its processor."""
    import json
    from pathlib import Path

    from transformers import (
        AutoProcessor,
        LlavaForConditionalGeneration,
        Qwen2VLForConditionalGeneration,
    )

    arch = json.loads((Path(model_dir) / "config.json").read_text())["architectures"][0]
    cls = LlavaForConditionalGeneration if arch.startswith("Llava") \
        else Qwen2VLForConditionalGeneration
    model = cls.from_pretrained(model_dir, dtype=dtype).eval()
    return model, AutoProcessor.from_pretrained(model_dir)


def prompt_inputs(processor, png: bytes, question: str):
    from PIL import Image

    messages = [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": question}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    image = Image.open(io.BytesIO(png)).convert("RGB")
    return processor(text=[text], images=[image], return_tensors="pt")


def image_span(inputs, image_token_id: int) -> tuple[int, int]:
    """``[first, last + 1)`` of the image tokens (row-break tokens between them included, as the
    plugin compresses them: ``controller.merge_runs``)."""
    where = torch.nonzero(inputs["input_ids"][0] == image_token_id).flatten()
    return int(where[0]), int(where[-1]) + 1


def _prune(cache, start: int, end: int, kept: list[torch.Tensor]) -> None:
    """Keep, per layer and head, text + the chosen span entries (kept[l]: [H, K] span-relative)."""
    for layer, entries in zip(cache.layers, kept, strict=True):
        for name in ("keys", "values"):
            full = getattr(layer, name)  # [1, H, T, D]
            span = full[:, :, start:end]
            index = entries.to(torch.int64)[None, :, :, None].expand(1, -1, -1, full.shape[-1])
            chosen = torch.gather(span, 2, index)
            setattr(layer, name, torch.cat([full[:, :, :start], chosen, full[:, :, end:]], dim=2))


def _mrope(model) -> bool:
    return hasattr(model.model, "get_rope_index")


@torch.no_grad()
def greedy_with_pruned_cache(model, inputs, span: tuple[int, int], kept: list[torch.Tensor] | None,
                             max_new_tokens: int, prune_at: int | None = None,
                             shift: int = 0) -> list[int]:
    """Greedy tokens; ``kept=None`` decodes on the full cache.

    ``prune_at=None``: prefill the whole prompt, then prune (a request that compressed its own
    image after prefill). ``prune_at=p``: prefill the first p tokens, prune, then prefill the
    rest on the pruned cache (a request that reuses a span cached by an earlier request whose
    first p tokens it shares). Positions: M-RoPE (Qwen2-VL) or 1-D (LLaVA), always the ones the
    uncompressed prompt gives each token, moved by ``shift`` for every token computed after the
    pruning (a deliberately wrong position, to show that positions matter).
    """
    ids = inputs["input_ids"]
    length = ids.shape[1]
    mrope = _mrope(model)
    if mrope:
        positions, deltas = model.model.get_rope_index(
            ids, image_grid_thw=inputs["image_grid_thw"],
            attention_mask=inputs["attention_mask"], mm_token_type_ids=inputs["mm_token_type_ids"])
    else:
        positions, deltas = torch.arange(length).view(1, -1), torch.zeros(1, 1, dtype=torch.long)
    deltas = deltas + shift
    if prune_at is None or kept is None:
        out = model(**inputs, use_cache=True)
        cache = out.past_key_values
        if kept is not None:
            _prune(cache, *span, kept)
    else:
        head = {k: (v[:, :prune_at] if k in ("input_ids", "attention_mask", "mm_token_type_ids")
                    else v) for k, v in inputs.items()}
        out = model(**head, position_ids=positions[..., :prune_at], use_cache=True)
        cache = out.past_key_values
        _prune(cache, *span, kept)
        start = cache.get_seq_length()
        out = model(input_ids=ids[:, prune_at:], past_key_values=cache,
                    position_ids=positions[..., prune_at:] + shift, use_cache=True,
                    cache_position=torch.arange(start, start + length - prune_at))
        cache = out.past_key_values
    tokens = [int(out.logits[0, -1].argmax())]
    for step in range(max_new_tokens - 1):
        position = (length + step + deltas).view(1, 1)
        if mrope:
            position = position.view(1, 1, 1).expand(3, 1, 1)
        out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache,
                    position_ids=position, use_cache=True,
                    cache_position=torch.tensor([cache.get_seq_length()]))
        cache = out.past_key_values
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


@torch.no_grad()
def hf_llava_greedy(model_dir, image, question: str, max_new_tokens: int) -> list[int]:
    """Greedy tokens of transformers' ``LlavaForConditionalGeneration`` (fp32, full cache) for
    one image (PNG bytes or a PIL image) and one question, in the chat layout the server uses.

    The reference for a 1-D RoPE checkpoint such as ``tiny_llava``'s: decode the result with
    ``skip_special_tokens=True`` and it equals a greedy ``/v1/chat/completions`` answer.
    """
    from PIL import Image
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(model_dir)
    if isinstance(image, bytes | bytearray):
        image = Image.open(io.BytesIO(image))
    messages = [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": question}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=[image.convert("RGB")], return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()
