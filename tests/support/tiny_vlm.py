"""Deterministic tiny random Qwen2-VL checkpoints (and Qwen2.5-VL, Qwen3-VL dense and MoE),
built offline in seconds.

Nothing can be downloaded from a model hub here, so tests and demos build their own checkpoint:
a byte-level BPE tokenizer trained on a small built-in corpus, Qwen2-VL's special tokens, a chat
template, an image processor config and random weights from a fixed seed. SGLang serves it with
its real model code (``Qwen2VLForConditionalGeneration`` and the others).

    python -m tests.support.tiny_vlm OUT_DIR [--image-size 224]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# Words the synthetic visual-QA task and the demos use, so they tokenize into few pieces.
_CORPUS_WORDS = (
    "what is the colour color of shape object at row column in image picture how many are there "
    "red green blue yellow purple orange white black grey gray cyan pink brown square circle "
    "triangle cross star diamond none zero one two three four five six seven eight nine ten "
    "left right top bottom middle center which where describe answer question list all objects "
    "yes no and or a an of to on is it this that user assistant system you are helpful screenshot "
    "button window click next step page text count colours colors shapes first second third"
)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_bpe(special_tokens: list[str], vocab_size: int, extra_words=()):
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on the built-in corpus (plus
    ``extra_words``) with ``special_tokens`` first: deterministic, the same for the same inputs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    words = _CORPUS_WORDS.split()
    words += [w for w in dict.fromkeys(extra_words) if w not in words]
    corpus = [" ".join(words[i:] + words[:i]) for i in range(len(words))]
    corpus += [w.capitalize() + "?" for w in words] + [f"{i}." for i in range(100)]
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def build_tokenizer(vocab_size: int = 640, extra_words: tuple[str, ...] | list[str] = ()):
    """A byte-level BPE tokenizer (deterministic: fixed corpus, fixed trainer settings).

    ``extra_words`` join the built-in corpus (e.g. a dataset's vocabulary, so its answers become
    one token per word); the default arguments reproduce the original tokenizer exactly.
    """
    return chatml_tokenizer(SPECIAL_TOKENS, CHAT_TEMPLATE, vocab_size, extra_words)


def chatml_tokenizer(special_tokens: list[str], chat_template: str, vocab_size: int = 640,
                     extra_words: tuple[str, ...] | list[str] = ()):
    """``train_bpe``'s tokenizer as a transformers tokenizer with ChatML's end and pad tokens
    (``special_tokens`` start with ``<|endoftext|>``) and ``chat_template``."""
    from transformers import PreTrainedTokenizerFast

    tok = train_bpe(special_tokens, vocab_size, extra_words)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=special_tokens[1:],
    )
    fast.chat_template = chat_template
    return fast


# Models whose processor expands one ``<image>`` token per image (InternVL, LLaVA-OneVision).
IMAGE_TOKEN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}<image>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_config(tokenizer, *, hidden: int = 64, layers: int = 2, vision_dim: int = 32,
                 heads: int = 4, kv_heads: int = 2, vision_depth: int = 2,
                 vision_heads: int = 2, context: int = 4096, intermediate: int | None = None):
    from transformers import Qwen2VLConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    head_dim = hidden // heads
    half = head_dim // 2
    mrope_section = [half - 2 * (half // 3), half // 3, half // 3]
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=context,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "mrope_section": mrope_section},
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    vision = dict(
        depth=vision_depth,
        embed_dim=vision_dim,
        hidden_size=hidden,
        num_heads=vision_heads,
        mlp_ratio=2,
        in_channels=3,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    config = Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    return config


def qwen2_5_config(tokenizer, *, hidden: int = 64, layers: int = 2, vision_dim: int = 32):
    """The Qwen2.5-VL variant of ``build_config``: a windowed vision tower (window 112 px, the
    last block full attention) with an MLP and RMSNorm, the same text model."""
    from transformers import Qwen2_5_VLConfig

    base = build_config(tokenizer, hidden=hidden, layers=layers, vision_dim=vision_dim)
    vision = dict(depth=2, hidden_size=vision_dim, out_hidden_size=hidden,
                  intermediate_size=2 * vision_dim, num_heads=2, in_channels=3, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                  fullatt_block_indexes=[1], tokens_per_second=2)
    return Qwen2_5_VLConfig(
        text_config=base.text_config.to_dict(),
        vision_config=vision,
        image_token_id=base.image_token_id,
        video_token_id=base.video_token_id,
        vision_start_token_id=base.vision_start_token_id,
        vision_end_token_id=base.vision_end_token_id,
        tie_word_embeddings=False,
    )


def build_tiny_qwen2_5_vl(out_dir: str | Path, *, image_size: int = 224, seed: int = 0) -> Path:
    """A tiny random Qwen2.5-VL checkpoint (``build_tiny_qwen2_vl``'s, with Qwen2.5's tower)."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(qwen2_5_config(tokenizer)).to(torch.bfloat16)
    return save_checkpoint(model, tokenizer, Path(out_dir), image_size=image_size,
                           architecture="Qwen2_5_VLForConditionalGeneration")


# Qwen3-VL: patch 16, merge 2, so an image is one token per 32 x 32 pixels; a 256 px square
# image gives 64 tokens (224 px would give 49).
QWEN3_VL_IMAGE_SIZE = 256
QWEN3_VL_FACTOR = 32


def qwen3_vl_config(tokenizer, *, moe: bool = False, hidden: int = 64, layers: int = 2,
                    heads: int = 4, kv_heads: int = 2, vision_dim: int = 32,
                    context: int = 4096):
    """A tiny Qwen3-VL (``moe``: Qwen3-VL-MoE) config: a 3-block vision tower whose blocks 0 and
    1 feed DeepStack (their merged features are added to the first two decoder layers' hidden
    states), interleaved M-RoPE over ``hidden / heads`` = 16-wide heads with QK norm, and for
    the MoE variant 4 experts, 2 per token, on every layer."""
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    head_dim = hidden // heads
    text = dict(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, max_position_embeddings=context, rms_norm_eps=1e-6,
        # Qwen3-VL's own layout ([24, 20, 20] over 64 pairs), scaled to 8 pairs, interleaved.
        rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                         "mrope_section": [4, 2, 2], "mrope_interleaved": True},
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"], tie_word_embeddings=False,
    )
    if moe:
        # moe_intermediate_size 96: no expert matrix is square, so the layout of each one on
        # disk is unambiguous (``_released_expert_layout``).
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96,
                    decoder_sparse_step=1, mlp_only_layers=[])
    vision = dict(depth=3, hidden_size=vision_dim, intermediate_size=2 * vision_dim,
                  num_heads=2, in_channels=3, patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=hidden, num_position_embeddings=256,
                  deepstack_visual_indexes=[0, 1])
    cls = Qwen3VLMoeConfig if moe else Qwen3VLConfig
    return cls(text_config=text, vision_config=vision,
               image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
               vision_start_token_id=ids["<|vision_start|>"],
               vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)


def build_tiny_qwen3_vl(out_dir: str | Path, *, image_size: int = QWEN3_VL_IMAGE_SIZE,
                        seed: int = 0, moe: bool = False) -> Path:
    """A tiny random Qwen3-VL checkpoint (``moe``: Qwen3-VL-MoE), the same tokenizer and chat
    template as ``build_tiny_qwen2_vl``'s.

    ``image_size`` fixes the processor's pixel budget: an ``image_size`` square image gives
    ``(image_size / 32) ** 2`` visual tokens (256 -> 64, 224 -> 49). ``out_dir``'s name should
    contain "qwen3-vl" (SGLang's frontend picks the Qwen-VL chat template by path).
    """
    import torch
    from transformers import (
        Qwen2VLImageProcessor,
        Qwen3VLForConditionalGeneration,
        Qwen3VLMoeForConditionalGeneration,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = qwen3_vl_config(tokenizer, moe=moe)
    torch.manual_seed(seed)
    cls = Qwen3VLMoeForConditionalGeneration if moe else Qwen3VLForConditionalGeneration
    model = cls(config).to(torch.bfloat16)
    model.generation_config.eos_token_id = config.text_config.eos_token_id
    model.save_pretrained(out)
    if moe:
        _released_expert_layout(out / "model.safetensors")
    vision = dict(size={"shortest_edge": QWEN3_VL_FACTOR ** 2,
                        "longest_edge": image_size * image_size},
                  patch_size=16, merge_size=2, temporal_patch_size=2)
    processor = Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(**vision, image_mean=[0.5] * 3,
                                              image_std=[0.5] * 3),
        video_processor=Qwen3VLVideoProcessor(**vision),
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)
    return out


def _released_expert_layout(path: Path) -> None:
    """Store Qwen3-VL-MoE's fused experts as the released checkpoints do (``gate_up_proj``
    ``[E, hidden, 2 * moe_intermediate]``, ``down_proj`` ``[E, moe_intermediate, hidden]``), the
    layout SGLang's loader transposes. transformers holds them transposed and saves them as it
    holds them; it transposes the released layout back when it loads (its shapes differ)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    for name, tensor in tensors.items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            tensors[name] = tensor.transpose(1, 2).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})


def _patch_config_json(path: Path, *, text_keys: dict, architecture: str) -> None:
    """Write the fields older readers (SGLang's model code) look for at the top level."""
    data = json.loads(path.read_text())
    data["vision_config"]["in_chans"] = data["vision_config"].get("in_channels", 3)
    data.setdefault("architectures", [architecture])
    for key, value in text_keys.items():
        data.setdefault(key, value)
    path.write_text(json.dumps(data, indent=2, sort_keys=True))


def build_tiny_qwen2_vl(out_dir: str | Path, *, image_size: int = 224, seed: int = 0,
                        hidden: int = 64, layers: int = 2, context: int = 4096,
                        heads: int = 4, intermediate: int | None = None) -> Path:
    """Write a complete checkpoint (weights, config, tokenizer, processor) to ``out_dir``.
    The language model has ``heads`` query heads over 2 KV heads and an MLP of ``intermediate``
    (default ``2 * hidden``).

    ``image_size`` fixes the processor's pixel budget: an ``image_size`` square image gives
    ``(image_size / 28) ** 2`` visual tokens (224 -> 64, 448 -> 256).
    """
    import torch
    from transformers import Qwen2VLForConditionalGeneration

    out = Path(out_dir)
    tokenizer = build_tokenizer()
    config = build_config(tokenizer, hidden=hidden, layers=layers, context=context, heads=heads,
                          intermediate=intermediate)
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).to(torch.bfloat16)
    return save_checkpoint(model, tokenizer, out, image_size=image_size)


def save_checkpoint(model, tokenizer, out_dir: str | Path, *, image_size: int = 224,
                    architecture: str = "Qwen2VLForConditionalGeneration") -> Path:
    """Write ``model`` (as is: its dtype), tokenizer, processor and chat template to ``out_dir``
    in the layout SGLang serves (``config.json`` with the top-level text fields it reads).

    ``image_size`` fixes the processor's pixel budget (``(image_size / 28) ** 2`` visual tokens).
    """
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = model.config
    model.generation_config.eos_token_id = config.text_config.eos_token_id
    model.save_pretrained(out)
    pixels = image_size * image_size
    image_processor = Qwen2VLImageProcessor(min_pixels=28 * 28, max_pixels=pixels)
    video_processor = Qwen2VLVideoProcessor(min_pixels=28 * 28, max_pixels=pixels)
    processor = Qwen2VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)
    text = config.text_config
    _patch_config_json(
        out / "config.json",
        architecture=architecture,
        text_keys={
            "vocab_size": text.vocab_size,
            "hidden_size": text.hidden_size,
            "num_hidden_layers": text.num_hidden_layers,
            "num_attention_heads": text.num_attention_heads,
            "num_key_value_heads": text.num_key_value_heads,
            "intermediate_size": text.intermediate_size,
            "rms_norm_eps": text.rms_norm_eps,
            "max_position_embeddings": text.max_position_embeddings,
            "rope_scaling": {"type": "mrope", "mrope_section":
                             text.rope_parameters["mrope_section"]},
            "rope_theta": text.rope_parameters["rope_theta"],
        },
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--image-size", type=int, default=224)
    args = parser.parse_args()
    print(build_tiny_qwen2_vl(args.out_dir, image_size=args.image_size))


if __name__ == "__main__":
    main()
