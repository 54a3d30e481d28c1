"""An independent reference for compressed decoding: transformers' Qwen2-VL with a pruned cache.

Given a prompt (one image + a question) and, per layer, the span-relative entries each KV head
keeps, it prefills with transformers, replaces the image span of every layer's cache with exactly
those entries, and decodes greedily with every new token at its original M-RoPE position. SGLang
serving the same checkpoint with the same kept set must produce the same tokens.
"""

from __future__ import annotations

import io

import torch


def load(model_dir, dtype=torch.float32):
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    model = Qwen2VLForConditionalGeneration.from_pretrained(model_dir, dtype=dtype).eval()
    return model, AutoProcessor.from_pretrained(model_dir)


def prompt_inputs(processor, png: bytes, question: str):
    from PIL import Image

    messages = [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": question}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    image = Image.open(io.BytesIO(png)).convert("RGB")
    return processor(text=[text], images=[image], return_tensors="pt")


def image_span(inputs, image_token_id: int) -> tuple[int, int]:
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


@torch.no_grad()
def greedy_with_pruned_cache(model, inputs, span: tuple[int, int], kept: list[torch.Tensor] | None,
                             max_new_tokens: int, prune_at: int | None = None) -> list[int]:
    """Greedy tokens; ``kept=None`` decodes on the full cache.

    ``prune_at=None``: prefill the whole prompt, then prune (a request that compressed its own
    image after prefill). ``prune_at=p``: prefill the first p tokens, prune, then prefill the
    rest on the pruned cache (a request that reuses a span cached by an earlier request whose
    first p tokens it shares).
    """
    ids = inputs["input_ids"]
    length = ids.shape[1]
    if prune_at is None or kept is None:
        out = model(**inputs, use_cache=True)
        cache = out.past_key_values
        deltas = model.model.rope_deltas  # [1, 1]: M-RoPE position of token t is t + delta
        if kept is not None:
            _prune(cache, *span, kept)
    else:
        positions, deltas = model.model.get_rope_index(
            ids, image_grid_thw=inputs["image_grid_thw"],
            attention_mask=inputs["attention_mask"], mm_token_type_ids=inputs["mm_token_type_ids"])
        head = {k: (v[:, :prune_at] if k in ("input_ids", "attention_mask", "mm_token_type_ids")
                    else v) for k, v in inputs.items()}
        out = model(**head, position_ids=positions[:, :, :prune_at], use_cache=True)
        cache = out.past_key_values
        _prune(cache, *span, kept)
        start = cache.get_seq_length()
        out = model(input_ids=ids[:, prune_at:], past_key_values=cache,
                    position_ids=positions[:, :, prune_at:], use_cache=True,
                    cache_position=torch.arange(start, start + length - prune_at))
        cache = out.past_key_values
    tokens = [int(out.logits[0, -1].argmax())]
    for step in range(max_new_tokens - 1):
        position = (length + step + deltas).view(1, 1, 1).expand(3, 1, 1)
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
