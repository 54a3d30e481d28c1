"""Every method of this library on a Hugging Face VLM, outside SGLang, in one line:

    from sglang_unicache.adapters.transformers import compress

    with compress(model, "snapkv", keep_ratio=0.1) as record:
        out = model.generate(**inputs, max_new_tokens=32)
    record.plans[0].image_plans()[0].layer_counts   # what each layer kept of the image

The same plan the SGLang plugin makes after prefill (``Method.plan`` on the prompt's post-RoPE
K/V and the last ``observation_window`` queries), applied to the model's ``DynamicCache`` right
after the prefill forward, so every later token attends to the compressed image, as in the
server. It is the press pattern of kvpress (NVIDIA/kvpress ``BasePress.__call__``): forward hooks,
nothing of the model patched, removed on exit.

Scope: batch size 1, the SDPA attention (``attn_implementation="sdpa"``: during decode it builds no
mask, so layers may hold different numbers of entries, which layer budgets need), a dynamic cache.
Image tokens are the runs of ``config.image_token_id`` (and ``video_token_id``) in ``input_ids``.
Decoder layers are found as ``model.model.language_model.layers`` (Qwen2-VL, Qwen2.5-VL) or
``model.model.layers``; each attention module needs ``q_proj``, ``head_dim`` and a module-level
``apply_rotary_pos_emb`` in its modeling file, as Qwen2-VL's has. Positions are untouched:
``generate`` tracks ``cache_position`` itself, so later tokens keep their original M-RoPE
positions, as the plugin's position rewrite does in the server.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from sglang_unicache.policy.config import UniCacheConfig
from sglang_unicache.policy.inputs import ImageSpan, ScoreInputs
from sglang_unicache.policy.plans import RequestPlan
from sglang_unicache.policy.registry import build_method

Tensor = torch.Tensor

__all__ = ["PressRecord", "compress", "image_spans"]


@dataclass
class PressRecord:
    """What the press did: one ``RequestPlan`` per compressed prefill (fallbacks included)."""

    plans: list[RequestPlan] = field(default_factory=list)
    image_tokens: int = 0  # image tokens the prefills held
    kept_entries: int = 0  # what the cache holds for them after compression, summed over layers
    layers: int = 0

    @property
    def kept_fraction(self) -> float:
        """Entries held per image token, averaged over layers (1.0 = nothing compressed)."""
        if not self.image_tokens or not self.layers:
            return 1.0
        return self.kept_entries / (self.image_tokens * self.layers)


def image_spans(input_ids: Tensor, token_ids: set[int]) -> list[ImageSpan]:
    """The maximal runs of ``token_ids`` in a 1-D ``input_ids``."""
    is_image = torch.isin(input_ids, torch.tensor(sorted(token_ids), device=input_ids.device))
    flags = is_image.to(torch.int8).cpu()
    edges = torch.diff(flags, prepend=torch.zeros(1, dtype=torch.int8),
                       append=torch.zeros(1, dtype=torch.int8))
    starts = (edges == 1).nonzero().flatten().tolist()
    ends = (edges == -1).nonzero().flatten().tolist()
    return [ImageSpan(s, e) for s, e in zip(starts, ends, strict=True)]


def _decoder_layers(model) -> list:
    inner = getattr(model, "model", model)
    for owner in (getattr(inner, "language_model", None), inner):
        if owner is not None and hasattr(owner, "layers"):
            return list(owner.layers)
    raise ValueError(f"unicache press: no decoder layers found on {type(model).__name__}")


def _image_token_ids(config) -> set[int]:
    ids = {getattr(config, name, None) for name in ("image_token_id", "video_token_id")}
    ids.discard(None)
    if not ids:
        raise ValueError("unicache press: the model config has no image_token_id")
    return ids


class _Press:
    """The hooks' shared state for one ``compress`` block."""

    def __init__(self, model, config: UniCacheConfig) -> None:
        self.method = build_method(config)
        self.window = config.observation_window
        self.token_ids = _image_token_ids(model.config)
        self.attentions = [layer.self_attn for layer in _decoder_layers(model)]
        self.record = PressRecord(layers=len(self.attentions))
        self.spans: list[ImageSpan] = []
        self.queries: dict[int, Tensor] = {}
        self.cache = None

    # -- hooks ------------------------------------------------------------------------------------
    def before_model(self, module, args, kwargs) -> None:
        """A prefill (no cached tokens yet) with image tokens arms the press."""
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        cache = kwargs.get("past_key_values")
        self.spans, self.queries, self.cache = [], {}, None
        if input_ids is None or input_ids.shape[1] <= 1:
            return
        if cache is not None and cache.get_seq_length() > 0:
            return  # a continued prompt: its earlier part was already compressed or kept
        if input_ids.shape[0] != 1:
            raise ValueError("unicache press: batch size 1 only (one prompt per generate call)")
        self.spans = image_spans(input_ids[0], self.token_ids)

    def after_attention(self, module, args, kwargs, output) -> None:
        """Keep the layer's post-RoPE queries of the last W prompt positions."""
        if not self.spans:
            return
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        cos, sin = kwargs["position_embeddings"]
        w = min(self.window, hidden.shape[1])
        q = module.q_proj(hidden[:, -w:]).view(1, w, -1, module.head_dim).transpose(1, 2)
        rotary = sys.modules[type(module).__module__].apply_rotary_pos_emb
        q, _ = rotary(q, q, cos[..., -w:, :], sin[..., -w:, :])
        self.queries[module.layer_idx] = q[0].transpose(0, 1).detach()  # [W, Hq, D]
        cache = kwargs.get("past_key_values")
        if cache is not None:
            self.cache = cache

    def after_model(self, module, args, kwargs, output) -> None:
        if self.spans and self.cache is not None:
            self._compress(self.cache)
        self.spans, self.queries, self.cache = [], {}, None

    # -- the compression --------------------------------------------------------------------------
    def _compress(self, cache) -> None:
        layers = cache.layers
        keys = [layer.keys[0].transpose(0, 1) for layer in layers]  # [T, H, D]
        values = [layer.values[0].transpose(0, 1) for layer in layers]
        t = keys[0].shape[0]
        queries = [self.queries[i] for i in range(len(layers))]
        w = queries[0].shape[0]
        inputs = ScoreInputs(keys, values, self.spans, obs_queries=queries,
                             obs_positions=torch.arange(t - w, t))
        plan = self.method.plan(inputs)
        self.record.plans.append(plan)
        image = plan.image_plans()
        done = [] if plan.fallback else [
            (p.span, self.method.execute(p, keys, values)) for p in image if not p.skipped]
        for li, layer in enumerate(layers if done else []):  # a fallback keeps the cache
            k_parts, v_parts, pos = [], [], 0
            for span, kv in done:
                k_parts += [keys[li][pos:span.start], kv.keys[li]]
                v_parts += [values[li][pos:span.start], kv.values[li]]
                pos = span.end
            k_parts.append(keys[li][pos:])
            v_parts.append(values[li][pos:])
            layer.keys = torch.cat(k_parts).transpose(0, 1).unsqueeze(0).contiguous()
            layer.values = torch.cat(v_parts).transpose(0, 1).unsqueeze(0).contiguous()
        image_tokens = sum(p.span.length for p in image)
        self.record.image_tokens += image_tokens
        # Whatever a layer holds beyond the prompt's other tokens is what it kept of the images.
        self.record.kept_entries += sum(layer.keys.shape[2] - (t - image_tokens)
                                        for layer in layers)

@contextmanager
def compress(
    model, config: UniCacheConfig | str = "unicache", **overrides
) -> Iterator[PressRecord]:
    """Compress every prefill's image KV inside the block with ``config`` (a method name or a
    ``UniCacheConfig``; keyword overrides such as ``keep_ratio=0.1`` apply on top)."""
    if isinstance(config, str):
        config = UniCacheConfig(method=config, **overrides)
    elif overrides:
        config = config.replace(**overrides)
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation != "sdpa":
        raise ValueError(f"unicache press: needs attn_implementation='sdpa' (layers may keep "
                         f"different numbers of entries), got {implementation!r}")
    press = _Press(model, config)
    top = getattr(model, "model", model)
    handles = [top.register_forward_pre_hook(press.before_model, with_kwargs=True),
               top.register_forward_hook(press.after_model, with_kwargs=True)]
    handles += [attn.register_forward_hook(press.after_attention, with_kwargs=True)
                for attn in press.attentions]
    try:
        yield press.record
    finally:
        for handle in handles:
            handle.remove()
