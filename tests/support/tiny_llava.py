"""A deterministic tiny random LLaVA checkpoint (1-D RoPE language model), built offline in seconds.

The Qwen2-VL checkpoint of ``tiny_vlm`` places its text tokens with M-RoPE; this one is the other
family: an HF ``LlavaForConditionalGeneration`` whose language model is a plain Llama (positions
``0, 1, 2, ...`` from ``forward_batch.positions``) and whose vision tower is Pixtral's, the layout
of ``mistral-community/pixtral-12b``. SGLang 0.5.23 serves it with its native
``LlavaForConditionalGeneration`` (sglang/srt/models/llava.py), which resolves each sub-config to a
native SGLang class: ``LlamaConfig -> LlamaForCausalLM`` and ``PixtralVisionConfig ->
PixtralVisionModel``. A CLIP vision tower does not work there: ``CLIPVisionModel`` is not in
SGLang's model registry, so the tower falls back to the Transformers backend, which fails
(``'Conv2d' object has no attribute 'num_embeddings'``).

Prompt layout of one image (Pixtral processor): every row of ``side / patch_size`` ``[IMG]``
tokens ends with ``[IMG_BREAK]``, the last row with ``[IMG_END]`` instead, so an ``image_size``
square image takes ``(n + 1) * n`` tokens with ``n = image_size // patch_size`` (112 px, patch 14:
64 ``[IMG]`` + 8 separators = 72). Images larger than ``image_size`` are scaled down to it.

    python -m tests.support.tiny_llava OUT_DIR [--image-size 112]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tests.support.tiny_vlm import train_bpe

SPECIAL_TOKENS = [
    "<unk>",
    "<s>",
    "</s>",
    "<pad>",
    "[INST]",
    "[/INST]",
    "[IMG]",
    "[IMG_BREAK]",
    "[IMG_END]",
]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}[INST]{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}[IMG]"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] == 'user' %}[/INST]{% else %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)


def build_tokenizer(vocab_size: int = 640):
    """A byte-level BPE tokenizer with Pixtral's image tokens (deterministic)."""
    from transformers import PreTrainedTokenizerFast

    tok = train_bpe(SPECIAL_TOKENS, vocab_size)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=SPECIAL_TOKENS[4:],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_config(tokenizer, *, image_size: int = 112, patch_size: int = 14, hidden: int = 64,
                 layers: int = 2, heads: int = 4, kv_heads: int = 2, vision_dim: int = 32,
                 vision_layers: int = 2, vision_heads: int = 2):
    from transformers import LlamaConfig, LlavaConfig, PixtralVisionConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=ids["<s>"],
        eos_token_id=ids["</s>"],
        pad_token_id=ids["<pad>"],
        tie_word_embeddings=False,
    )
    vision = PixtralVisionConfig(
        hidden_size=vision_dim,
        intermediate_size=2 * vision_dim,
        num_hidden_layers=vision_layers,
        num_attention_heads=vision_heads,
        image_size=image_size,
        patch_size=patch_size,
        hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=ids["[IMG]"],
        projector_hidden_act="gelu",
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        tie_word_embeddings=False,
    )


def _legacy_key(name: str) -> str:
    """transformers 5 names -> the (pre-4.52) layout SGLang's loader expects; transformers still
    reads it back through its own key mapping."""
    for new, old in (("model.language_model.", "language_model.model."),
                     ("model.vision_tower.", "vision_tower."),
                     ("model.multi_modal_projector.", "multi_modal_projector."),
                     ("lm_head.", "language_model.lm_head.")):
        if name.startswith(new):
            return old + name[len(new):]
    return name


def build_tiny_llava(out_dir: str | Path, *, seed: int = 0, image_size: int = 112,
                     hidden: int = 64, layers: int = 2) -> Path:
    """Write a complete checkpoint (weights, config, tokenizer, processor) to ``out_dir``.

    ``image_size`` is the longest image side the processor keeps (and the vision tower's
    ``image_size``): a square image takes ``(n + 1) * n`` prompt tokens, ``n = image_size // 14``.
    """
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import LlavaForConditionalGeneration

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = build_config(tokenizer, image_size=image_size, hidden=hidden, layers=layers)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).to(torch.bfloat16)
    model.generation_config.eos_token_id = config.text_config.eos_token_id
    model.save_pretrained(out)
    weights = out / "model.safetensors"
    state = load_file(weights)
    save_file({_legacy_key(k): v.contiguous() for k, v in state.items()}, weights,
              metadata={"format": "pt"})
    _save_processor(tokenizer, out, image_size=image_size,
                    patch_size=config.vision_config.patch_size)
    _patch_config_json(out / "config.json")
    return out


def _save_processor(tokenizer, out: Path, *, image_size: int, patch_size: int) -> None:
    from transformers import PixtralImageProcessor, PixtralProcessor

    image_processor = PixtralImageProcessor(size={"longest_edge": image_size},
                                            patch_size=patch_size)
    processor = PixtralProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                 patch_size=patch_size, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(out)


def _patch_config_json(path: Path) -> None:
    data = json.loads(path.read_text())
    data["architectures"] = ["LlavaForConditionalGeneration"]
    path.write_text(json.dumps(data, indent=2, sort_keys=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--image-size", type=int, default=112)
    args = parser.parse_args()
    print(build_tiny_llava(args.out_dir, image_size=args.image_size))


if __name__ == "__main__":
    main()
